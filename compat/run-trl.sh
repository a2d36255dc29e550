#!/usr/bin/env bash
# TRL's SFT, DPO and GRPO trainers through the compat package, against real DeepSpeed 0.19.8.
# Builds (once) two venvs with the CPU torch, trl, transformers, accelerate and datasets:
#   $TRL_VENV    (default .trl-venv):    shardwise and compat/deepspeed from this tree (editable)
#   $TRL_DS_VENV (default .trl-ds-venv): DeepSpeed 0.19.8 (--no-deps, plus what it imports); TRL_DS=0 skips it
# then runs examples/trl/train.py (2 processes, torchrun, --deepspeed ZeRO-2 and ZeRO-3 configs, fp32 on CPU)
# in each, on a tiny random Llama with a locally trained tokenizer, and compares the logged losses.
# Usage: compat/run-trl.sh [OUTDIR] [TRAINERS] [STAGES]   (defaults: .trl-out, "sft dpo grpo", "2 3")
# About 6 minutes on two cores (venvs: a few more the first time); not part of `make test`.
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
OUT=$(mkdir -p "${1:-$REPO/.trl-out}" && cd "${1:-$REPO/.trl-out}" && pwd)
TRAINERS=${2:-sft dpo grpo}
STAGES=${3:-2 3}
VENV=${TRL_VENV:-$REPO/.trl-venv}
DS_VENV=${TRL_DS_VENV:-$REPO/.trl-ds-venv}
PKGS="torch==2.13.0 trl accelerate transformers datasets"

if [ ! -f "$VENV/.ready" ]; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q $PKGS "setuptools>=77"
  "$VENV/bin/pip" install -q -e "$REPO"
  "$VENV/bin/pip" install -q --no-build-isolation -e "$REPO/compat/deepspeed"
  touch "$VENV/.ready"
fi
SIDES="compat"; ONLY=--compat_only
if [ "${TRL_DS:-1}" != 0 ]; then
  if [ ! -f "$DS_VENV/.ready" ]; then
    python3 -m venv "$DS_VENV"
    "$DS_VENV/bin/pip" install -q $PKGS hjson ninja psutil py-cpuinfo msgpack pydantic einops
    "$DS_VENV/bin/pip" install -q --no-deps deepspeed==0.19.8
    touch "$DS_VENV/.ready"
  fi
  SIDES="compat deepspeed"; ONLY=
fi
"$VENV/bin/python" -c "import deepspeed; assert deepspeed.__shardwise__, deepspeed.__file__"

cd "$REPO"
[ -f "$OUT/tiny/config.json" ] || "$VENV/bin/python" examples/trl/train.py --make_model "$OUT/tiny" > /dev/null
for side in $SIDES; do
  if [ "$side" = compat ]; then bin=$VENV/bin; else bin=$DS_VENV/bin; fi
  for t in $TRAINERS; do
    for z in $STAGES; do
      log=$OUT/$side-$t-z$z
      rm -f "$log.json"
      echo "== $side $t ZeRO-$z" >&2
      if ! PATH="$bin:$PATH" DS_ACCELERATOR=cpu timeout 900 "$bin/torchrun" --nproc_per_node 2 \
          examples/trl/train.py --trainer "$t" --model "$OUT/tiny" --deepspeed "examples/trl/ds_zero$z.json" \
          --output_dir "$OUT/run-$side-$t-z$z" --losses "$log.json" > "$log.log" 2>&1; then
        echo "failed: $side $t ZeRO-$z (see $log.log)" >&2
        grep -E "^\[rank0\]: [A-Za-z.]*(Error|Exception)" "$log.log" | tail -1 >&2 || true
      fi
    done
  done
done
"$VENV/bin/python" examples/trl/compare.py $ONLY "$OUT" | tee "$OUT/summary.txt"
