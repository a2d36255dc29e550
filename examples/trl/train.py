"""TRL's SFT, DPO and GRPO trainers on a tiny local model, as a client of whichever ``deepspeed`` is installed.

    python examples/trl/train.py --make_model tiny-trl          # tokenizer + random Llama, no downloads
    torchrun --nproc_per_node 2 examples/trl/train.py --trainer dpo --model tiny-trl \\
        --deepspeed examples/trl/ds_zero3.json --output_dir out --losses losses.json

Nothing here mentions shardwise: with ``compat/deepspeed`` installed the runs go through shardwise, with
DeepSpeed installed through DeepSpeed (``DS_ACCELERATOR=cpu`` on a CPU machine). fp32, CPU processes.

- ``sft``: ``SFTTrainer`` on prompt + response texts from examples/chat/train.json.
- ``dpo``: ``DPOTrainer`` with the response as chosen and another record's response as rejected. TRL loads
  the reference model itself and wraps it with its own ``prepare_deepspeed`` (ZeRO-3 when training is ZeRO-3).
- ``grpo``: ``GRPOTrainer`` with a small reward function and ``beta`` > 0 (so a reference model too); TRL
  samples completions inside ``unwrap_model_for_generation``, which gathers ZeRO-3 weights once.

``--losses`` writes the trainer's log history (loss, grad_norm, rewards, ...) as JSON on rank 0.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.join(HERE, "..", "chat", "train.json")


def records() -> list[dict]:
    with open(DATA, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def make_model(out: str) -> None:
    sys.path.insert(0, os.path.join(HERE, "..", "chat"))
    from make_tiny_model import make_tiny_model, texts_from_files

    make_tiny_model(out, texts_from_files([DATA]), hidden=32, layers=2, heads=4, vocab_size=400, seed=0,
                    init_std=0.2)
    print(f"wrote {out}")


def reward_distinct(completions, **kwargs) -> list[float]:
    """The share of distinct characters in each completion (deterministic, no model)."""
    return [len(set(c)) / max(len(c), 1) for c in completions]


def dataset(kind: str):
    from datasets import Dataset

    rs = records()
    if kind == "sft":
        rows = [{"text": r["prompt"] + "\n" + r["response"]} for r in rs]
    elif kind == "dpo":
        rows = [{"prompt": r["prompt"], "chosen": r["response"], "rejected": rs[(i + 7) % len(rs)]["response"]}
                for i, r in enumerate(rs)]
    else:
        rows = [{"prompt": r["prompt"][:24]} for r in rs]
    return Dataset.from_list(rows)


def common(a) -> dict:
    return dict(output_dir=a.output_dir, per_device_train_batch_size=2, max_steps=a.max_steps, logging_steps=1,
                learning_rate=a.lr, use_cpu=True, deepspeed=a.deepspeed, bf16=False, report_to=[],
                save_strategy="no", seed=3, data_seed=3, disable_tqdm=True, dataloader_num_workers=0)


def build_trainer(a, model, tokenizer):
    if a.trainer == "sft":
        from trl import SFTConfig, SFTTrainer

        args = SFTConfig(max_length=64, **common(a))
        return SFTTrainer(model=model, args=args, train_dataset=dataset("sft"), processing_class=tokenizer)
    if a.trainer == "dpo":
        from trl import DPOConfig, DPOTrainer

        args = DPOConfig(max_length=64, beta=0.1, **common(a))
        return DPOTrainer(model=model, args=args, train_dataset=dataset("dpo"), processing_class=tokenizer)
    from trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(num_generations=4, max_completion_length=8, beta=0.04, temperature=1.0, **common(a))
    return GRPOTrainer(model=model, reward_funcs=reward_distinct, args=args, train_dataset=dataset("grpo"),
                       processing_class=tokenizer)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--make_model", metavar="DIR", help="write the tiny model folder and exit")
    p.add_argument("--trainer", choices=["sft", "dpo", "grpo"], default="sft")
    p.add_argument("--model")
    p.add_argument("--deepspeed", default=None, help="DeepSpeed config (JSON); without it plain DDP")
    p.add_argument("--output_dir", default="trl-out")
    p.add_argument("--max_steps", type=int, default=3)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--losses", help="write the log history here (rank 0)")
    p.add_argument("--local_rank", type=int, default=-1)
    a = p.parse_args()
    if a.make_model:
        return make_model(a.make_model)
    from transformers import AutoTokenizer, set_seed

    if a.deepspeed:
        import deepspeed

        if not getattr(deepspeed, "__shardwise__", False):  # real DeepSpeed on CPU: its comm must be up before
            deepspeed.init_distributed(dist_backend="gloo")  # zero.Init, or it sees a world of one process
    tokenizer = AutoTokenizer.from_pretrained(a.model)
    # the model goes in as a path: TRL loads it after building its config, so ZeRO-3's zero.Init applies
    trainer = build_trainer(a, a.model, tokenizer)
    set_seed(3)
    trainer.train()
    if a.losses and trainer.is_world_process_zero():
        ref = getattr(trainer, "ref_model", None)
        with open(a.losses, "w") as f:
            json.dump({"deepspeed": deepspeed_version(), "engine": type(trainer.model_wrapped).__name__,
                       "stage": zero_stage(trainer.model_wrapped),
                       "ref_model": type(ref).__name__ if ref is not None else None, "ref_stage": zero_stage(ref),
                       "history": trainer.state.log_history}, f, indent=1)


def zero_stage(engine) -> int | None:
    return engine.zero_optimization_stage() if hasattr(engine, "zero_optimization_stage") else None


def deepspeed_version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("deepspeed")
    except PackageNotFoundError:
        return None


if __name__ == "__main__":
    main()
