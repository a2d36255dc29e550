#!/usr/bin/env bash
# DeepSpeed-Chat (DeepSpeedExamples/applications/DeepSpeed-Chat) steps 1, 2 and 3, files unchanged, on a tiny
# local OPT (random weights, a tokenizer trained here, DS-Chat's local/jsonfile data; no hub), 2 CPU processes:
#   step 1 (SFT) and step 2 (reward model): ZeRO-2 + --offload, bf16;
#   step 3 (PPO, hybrid engine): 3 steps at ZeRO-2, ZeRO-3, and ZeRO-3 with an actor LoRA; saves actor and critic.
# Every saved model is then loaded back. With real DeepSpeed (DS_VENV, default /work/ds-venv) present, the same
# runs go through it too and the losses are printed side by side (docs/deepspeed-chat.md). Exit status: shardwise's.
# Builds (once) venvs under DSCHAT_VENV (default .dschat-venv): base = CPU torch + DS-Chat's pins
# (transformers 4.57, datasets < 5) + shardwise from this tree (editable); sw = base + compat/deepspeed as
# `deepspeed`; ds = DS_VENV's deepspeed over base. Not part of `make test`; ~10-15 minutes on two cores.
# Usage: compat/run-deepspeed-chat.sh   env: DSCHAT_SRC (a DeepSpeedExamples checkout or bare git mirror;
#   default: clone github.com/deepspeedai/DeepSpeedExamples), DSCHAT_OUT (default .dschat-out),
#   DSCHAT_BACKENDS (default "shardwise deepspeed"), DSCHAT_STEPS (default "1 2 3").
set -euo pipefail
REPO=${SHARDWISE_REPO:-$(cd "$(dirname "$0")/.." && pwd)}  # (set when running a copy of this script)
ROOT=${DSCHAT_VENV:-$REPO/.dschat-venv}
OUT=${DSCHAT_OUT:-$REPO/.dschat-out}
DS_VENV=${DS_VENV:-/work/ds-venv}
BACKENDS=${DSCHAT_BACKENDS:-shardwise deepspeed}
STEPS=${DSCHAT_STEPS:-1 2 3}
export DS_ACCELERATOR=cpu TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1
# real DeepSpeed JIT-builds cpu_adam here (its own folder: a lock left in the shared cache by a killed build hangs it)
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$ROOT/torch_extensions}

site() { "$1/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])"; }
overlay() {  # overlay VENV DIR...: a pip-less venv that sees DIR... (in that order) through a .pth file
  local venv=$1; shift
  python3 -m venv --without-pip "$venv"
  local lines=""
  for d in "$@"; do lines+="import site; site.addsitedir('$d')"$'\n'; done
  printf '%s' "$lines" > "$(site "$venv")/_dschat_base.pth"
}
if [ ! -f "$ROOT/.ready" ]; then
  rm -rf "$ROOT" && mkdir -p "$ROOT"
  python3 -m venv "$ROOT/base"
  "$ROOT/base/bin/pip" install -q torch==2.13.0 "transformers>=4.57,<4.58" "datasets<5" "setuptools>=77" \
    tensorboard sentencepiece "accelerate<1.12"
  "$ROOT/base/bin/pip" install -q -e "$REPO"
  overlay "$ROOT/sw" "$(site "$ROOT/base")"
  cp -r "$REPO/compat/deepspeed" "$ROOT/compat-build" && rm -rf "$ROOT/compat-build"/*.egg-info
  "$ROOT/sw/bin/python" -m pip install -q --no-deps --no-build-isolation --no-index "$ROOT/compat-build"
  rm -rf "$ROOT/compat-build"
  touch "$ROOT/.ready"
fi
if [ -x "$DS_VENV/bin/python" ] && [ ! -d "$ROOT/ds" ]; then
  overlay "$ROOT/ds" "$(site "$DS_VENV")" "$(site "$ROOT/base")"
fi

# DS-Chat's files, unchanged; data/ is where its local/jsonfile dataset reads from
SRC=${DSCHAT_SRC:-}
mkdir -p "$OUT"
CHAT=$OUT/DeepSpeed-Chat
if [ ! -d "$CHAT" ]; then
  if [ -z "$SRC" ]; then
    git clone -q --depth 1 https://github.com/deepspeedai/DeepSpeedExamples "$OUT/DeepSpeedExamples"
    SRC=$OUT/DeepSpeedExamples
  fi
  if [ -d "$SRC/applications/DeepSpeed-Chat" ]; then
    cp -r "$SRC/applications/DeepSpeed-Chat" "$CHAT"
  else  # a bare git mirror (its large media files may be absent: assets/ is not needed)
    parts=$(git -C "$SRC" ls-tree --name-only HEAD applications/DeepSpeed-Chat/ | grep -v /assets$)
    # shellcheck disable=SC2086
    git -C "$SRC" archive HEAD $parts | tar -x -C "$OUT"
    mv "$OUT/applications/DeepSpeed-Chat" "$CHAT"
    rm -rf "$OUT/applications"
  fi
  "$ROOT/base/bin/python" "$REPO/compat/deepspeed_chat_prepare.py" "$OUT/tiny-opt" "$CHAT"
fi
MODEL=$OUT/tiny-opt
COMMON=(--data_path local/jsonfile --data_split 2,4,4 --seed 1234 --dtype bf16 --deepspeed)

run() {  # run BACKEND NAME STEPDIR ARGS...: one DS-Chat main.py on 2 processes; log in $OUT/BACKEND/NAME.log
  local backend=$1 name=$2 step=$3; shift 3
  local venv=$ROOT/sw launcher=("$ROOT/sw/bin/deepspeed") path=$CHAT:$REPO:$REPO/compat/deepspeed  # this tree wins
  [ "$backend" = deepspeed ] && venv=$ROOT/ds launcher=("$ROOT/ds/bin/python" "$DS_VENV/bin/deepspeed") path=$CHAT
  local dir=$OUT/$backend
  mkdir -p "$dir"
  echo "== $backend $name"
  (cd "$CHAT/training/$step" && PATH="$venv/bin:$PATH" PYTHONPATH="$path" \
    "${launcher[@]}" --num_gpus 2 --master_port "$((29500 + RANDOM % 1000))" main.py "$@" \
    --data_output_path "$dir/data_files" --output_dir "$dir/$name" > "$dir/$name.log" 2>&1) \
    || { tail -40 "$dir/$name.log"; echo "FAILED: $backend $name (log: $dir/$name.log)"; return 1; }
}

status=0  # shardwise's failures count; real DeepSpeed's are only reported (docs/deepspeed-chat.md)
for backend in $BACKENDS; do
  failed=0
  if [ "$backend" = deepspeed ] && [ ! -d "$ROOT/ds" ]; then echo "no real DeepSpeed at $DS_VENV: skipped"; continue; fi
  for s in $STEPS; do
    case $s in
      1) run "$backend" step1 step1_supervised_finetuning "${COMMON[@]}" --model_name_or_path "$MODEL" \
           --per_device_train_batch_size 4 --per_device_eval_batch_size 4 --max_seq_len 64 --learning_rate 1e-3 \
           --num_train_epochs 1 --lr_scheduler_type cosine --num_warmup_steps 0 --zero_stage 2 --offload \
           || failed=1 ;;
      2) run "$backend" step2 step2_reward_model_finetuning "${COMMON[@]}" --model_name_or_path "$MODEL" \
           --num_padding_at_beginning 1 --per_device_train_batch_size 4 --per_device_eval_batch_size 4 \
           --max_seq_len 64 --learning_rate 1e-3 --num_train_epochs 1 --lr_scheduler_type cosine \
           --num_warmup_steps 0 --zero_stage 2 --offload || failed=1 ;;
      3) for z in 2 3 3-lora; do
           lora=(); [ "$z" = 3-lora ] && lora=(--actor_lora_dim 4 --actor_lora_module_name decoder.layers.)
           run "$backend" "step3-zero$z" step3_rlhf_finetuning "${COMMON[@]}" \
             --actor_model_name_or_path "$OUT/$backend/step1" --critic_model_name_or_path "$OUT/$backend/step2" \
             --num_padding_at_beginning 1 --per_device_generation_batch_size 4 --per_device_training_batch_size 4 \
             --generation_batches 1 --ppo_epochs 1 --max_prompt_seq_len 32 --max_answer_seq_len 16 \
             --actor_learning_rate 1e-4 --critic_learning_rate 1e-4 --num_train_epochs 1 --num_warmup_steps 0 \
             --actor_zero_stage "${z%-lora}" --critic_zero_stage "${z%-lora}" --enable_hybrid_engine "${lora[@]}" \
             --enable_test_mode --test_stop_step 3 || failed=1
         done ;;
    esac
  done
  "$ROOT/base/bin/python" - "$OUT/$backend" <<'EOF' || failed=1
import sys, torch
from pathlib import Path
from transformers import AutoModelForCausalLM
root = Path(sys.argv[1])
for sub in ["step1", "step3-zero2/actor", "step3-zero3/actor", "step3-zero3-lora/actor"]:
    if (root / sub / "config.json").exists():
        m, info = AutoModelForCausalLM.from_pretrained(root / sub, output_loading_info=True)
        assert not info["missing_keys"] and not info["mismatched_keys"], (sub, info)
        out = m(torch.tensor([[2, 40, 41, 42]])).logits
        assert torch.isfinite(out).all(), sub
        print(f"loaded {sub}: {sum(p.numel() for p in m.parameters())} parameters, logits finite")
for sub in ["step2", "step3-zero2/critic", "step3-zero3/critic", "step3-zero3-lora/critic"]:
    f = root / sub / "pytorch_model.bin"
    if f.exists():
        state = torch.load(f, map_location="cpu", weights_only=True)
        empty = [k for k, v in state.items() if v.numel() == 0]
        assert not empty and "v_head.weight" in state, (sub, empty[:3])
        assert all(torch.isfinite(v.float()).all() for v in state.values()), sub
        print(f"loaded {sub}: {len(state)} tensors, none empty, all finite")
EOF
  [ "$failed" = 0 ] || [ "$backend" != shardwise ] || status=1
done
"$ROOT/base/bin/python" "$REPO/compat/deepspeed_chat_report.py" "$OUT" $BACKENDS
exit $status
