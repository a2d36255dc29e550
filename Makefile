# Two entry points, both starting from a fresh machine:
#   make demo   - create .venv, install shardwise, train the demo GPT on 2 CPU processes
#   make test   - create .venv, install shardwise with test extras, run the test suite
#   make deepspeed-unit-tests - DeepSpeed's own unit tests through compat/deepspeed (~10 min; own venv)
#   make deepspeed-chat - DeepSpeed-Chat steps 1-3 unchanged on a tiny local OPT, against real DeepSpeed if present
#   make trl-check - TRL's SFT/DPO/GRPO at ZeRO-2/3 through compat/deepspeed vs DeepSpeed 0.19.8 (~6 min; own venvs)
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of torch; a plain `pip install torch` would pull a multi-GB CUDA build.
TORCH_PIN ?= torch==2.13.0

.PHONY: demo test bench gpu-check install clean deepspeed-unit-tests deepspeed-chat trl-check

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH_PIN)
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

install: $(VENV)/.installed

demo: $(VENV)/.installed
	$(VENV)/bin/shardwise run --num_procs 2 examples/gpt/train.py \
		--deepspeed --deepspeed_config examples/gpt/ds_config.json

test: $(VENV)/.installed
	$(PY) -m pytest -q

deepspeed-unit-tests:
	compat/run-deepspeed-unit-tests.sh

# docs/deepspeed-chat.md; own venvs (.dschat-venv), outputs in .dschat-out; ~15 min on two cores
deepspeed-chat:
	compat/run-deepspeed-chat.sh

# docs/hf-trainer.md (TRL); own venvs (.trl-venv, .trl-ds-venv), outputs in .trl-out; ~6 min on two cores
trl-check:
	compat/run-trl.sh

bench: $(VENV)/.installed
	$(PY) benchmarks/zero_vs_ddp.py

# The engine at ZeRO 0-3 (+ CPU offload) against a plain torch loop on one CUDA device, bf16: losses,
# step time, tokens/s, MFU. Needs a CUDA build of torch in $(VENV) (TORCH_PIN); skips, exit 0, without CUDA.
gpu-check: $(VENV)/.installed
	$(PY) benchmarks/gpu_check.py $(GPU_CHECK_ARGS)

clean:
	rm -rf $(VENV) checkpoints *.egg-info .dsu-venv .dsu-out .dsu-out.summary.txt .dschat-venv .dschat-out .trl-venv .trl-ds-venv .trl-out
