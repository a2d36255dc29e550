#!/usr/bin/env bash
# Find every test of DeepSpeed's unit-test tarball that passes under real DeepSpeed 0.19.8 on this CPU harness
# (not only the harness's deepspeed-passing.txt), then run those through the compat package.
# Usage: compat/tools/dsu_discover.sh [WORKDIR]      (default WORKDIR: ./.dsu-discover)
#   env DSU_HARNESS: the harness folder (run.sh, tarball; default ../shared/deepspeed-unit-tests)
# Steps, each kept in WORKDIR so a rerun skips what is done:
#   1. a throwaway venv with real DeepSpeed 0.19.8 (the measuring stick; never a shardwise dependency), and
#      DeepSpeed's CPU ops (fused_adam, cpu_adam, deepspeed_shm_comm) compiled once up front: a test that
#      compiles one and is cut off by the harness's time limit leaves a lock in ~/.cache/torch_extensions
#      that hangs every later test using that op
#   2. all-nodes.txt: every test pytest selects in the tarball (its pytest.ini deselects GPU-only markers)
#   3. real/: the tests run under DeepSpeed file by file (compat/tools/dsu_per_file.py: niced, each file
#      capped, outcomes per test in real/results.jsonl), less the GPU-kernel-only folders (FastGen's
#      kernels and modules, the fused transformer and Evoformer ops); deepspeed-passing-all.txt: those
#      that passed
#   4. compat/: the same tests through compat/deepspeed, file by file
# Hours on two cores; on a loaded machine DeepSpeed's own distributed tests exceed the hang limit and count
# as not passing: rerun those alone (dsu_per_file.py with a selection of them) before concluding.
set -uo pipefail
REPO=$(cd "$(dirname "$0")/../.." && pwd)
WORK=$(mkdir -p "${1:-$PWD/.dsu-discover}" && cd "${1:-$PWD/.dsu-discover}" && pwd)
HARNESS=${DSU_HARNESS:-$REPO/../shared/deepspeed-unit-tests}
HARNESS=$(cd "$HARNESS" && pwd) || { echo "no harness: set DSU_HARNESS" >&2; exit 2; }
DSV="$WORK/ds-venv"
if [ ! -f "$DSV/.ready" ]; then
  python3 -m venv "$DSV"
  "$DSV/bin/pip" install -q torch==2.13.0 pytest pytest-timeout
  "$DSV/bin/pip" install -q --no-deps deepspeed==0.19.8 hjson ninja psutil py-cpuinfo msgpack pydantic pydantic-core \
    annotated-types typing-inspection packaging tqdm numpy einops
  touch "$DSV/.ready"
fi
if [ ! -s "$WORK/all-nodes.txt" ]; then
  rm -rf "$WORK/collect" && mkdir -p "$WORK/collect/tmp"
  tar xzf "$HARNESS/deepspeed-tests-edaa722.tar.gz" -C "$WORK/collect"
  (cd "$WORK/collect/tests" && OMP_NUM_THREADS=1 DS_ACCELERATOR=cpu LOCAL_SIZE=2 TMPDIR="$WORK/collect/tmp" \
     PYTHONPATH="$REPO/compat/tools" DSU_IDS_OUT="$WORK/all-nodes.txt" \
     "$DSV/bin/python" -m pytest -p no:cacheprovider -p dsu_ids --collect-only -q --continue-on-collection-errors unit \
     > "$WORK/collect.log" 2>&1)
fi
echo "$(wc -l < "$WORK/all-nodes.txt") tests selected in the tarball"
SKIP=(unit/inference/v2/kernels/ unit/inference/v2/modules/ unit/ops/transformer/ unit/ops/deepspeed4science/)
if [ ! -s "$WORK/deepspeed-passing-all.txt" ]; then
  (cd "$WORK" && DS_ACCELERATOR=cpu "$DSV/bin/python" -c "
from deepspeed.accelerator import get_accelerator
for b in ('FusedAdamBuilder', 'CPUAdamBuilder', 'ShareMemCommBuilder'):
    get_accelerator().create_op_builder(b).load()")
  "$DSV/bin/python" "$REPO/compat/tools/dsu_per_file.py" "$DSV" "$WORK/all-nodes.txt" "$WORK/real" --smallest-first --skip "${SKIP[@]}"
  "$DSV/bin/python" "$REPO/compat/tools/dsu_per_file.py" --passed "$WORK/real" "$WORK/all-nodes.txt" \
    > "$WORK/deepspeed-passing-all.txt"
fi
echo "$(wc -l < "$WORK/deepspeed-passing-all.txt") pass under DeepSpeed 0.19.8"
CV="$WORK/compat-venv"   # as compat/run-deepspeed-unit-tests.sh builds it
if [ ! -f "$CV/.ready" ]; then
  python3 -m venv "$CV"
  "$CV/bin/pip" install -q torch==2.13.0 pytest pytest-timeout hjson py-cpuinfo "setuptools>=77"
  "$CV/bin/pip" install -q -e "$REPO" && "$CV/bin/pip" install -q --no-build-isolation -e "$REPO/compat/deepspeed"
  touch "$CV/.ready"
fi
"$DSV/bin/python" "$REPO/compat/tools/dsu_per_file.py" "$CV" "$WORK/deepspeed-passing-all.txt" "$WORK/compat"
"$DSV/bin/python" "$REPO/compat/tools/dsu_per_file.py" --summary "$WORK/compat" "$WORK/deepspeed-passing-all.txt"
