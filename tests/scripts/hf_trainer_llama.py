"""A plain Hugging Face ``Trainer`` script (nothing shardwise in it), for tests/test_hf_trainer.py.

    python hf_trainer_llama.py --model DIR --out DIR --report FILE [--deepspeed none|A.json [B.json ...]]
                               [--resume_from_step N]

``train()`` is the usual script: ``TrainingArguments(deepspeed=cfg, use_cpu=True)``, then the model
(loaded after the arguments, so under ZeRO-3 ``from_pretrained`` builds it inside
``deepspeed.zero.Init``), ``Trainer(...).train()`` on fixed random token data, a checkpoint every
--save_steps steps, and ``trainer.save_model()``. Without --deepspeed (or with ``none``) it runs on
plain DDP. To save
process start-ups the test runs several trainings in one launch: one per config given (each in
OUT/<config name>), each DeepSpeed one followed, with --resume_from_step N, by a second run (in OUT/<name>-resume)
resuming from its checkpoint-N. Rank 0 writes the logged losses, learning rates and grad norms of every run to --report.
"""
import argparse
import json
import os

import torch
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments


class TokenData(torch.utils.data.Dataset):
    def __init__(self, vocab: int, n: int = 64, length: int = 12) -> None:
        g = torch.Generator().manual_seed(11)
        self.ids = torch.randint(3, vocab, (n, length), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def train(model_dir, out, ds_config, resume, *, max_steps, save_steps, grad_accum):
    args = TrainingArguments(output_dir=out, per_device_train_batch_size=2, gradient_accumulation_steps=grad_accum,
                             max_steps=max_steps, learning_rate=3e-3, weight_decay=0.01, logging_steps=1,
                             save_strategy="steps", save_steps=save_steps, report_to=[], use_cpu=True,
                             deepspeed=ds_config, seed=7, disable_tqdm=True)
    model = AutoModelForCausalLM.from_pretrained(model_dir)  # after TrainingArguments: zero.Init under ZeRO-3
    partitioned_at_load = hasattr(next(model.parameters()), "ds_numel")
    trainer = Trainer(model=model, args=args, train_dataset=TokenData(model.config.vocab_size))
    trainer.train(resume_from_checkpoint=resume)
    trainer.save_model(os.path.join(out, "final"))
    logs = [r for r in trainer.state.log_history if "loss" in r]
    return {"steps": [r["step"] for r in logs], "loss": [r["loss"] for r in logs],
            "lr": [r["learning_rate"] for r in logs], "grad_norm": [r.get("grad_norm") for r in logs],
            "wrapper": type(trainer.model_wrapped).__module__ + "." + type(trainer.model_wrapped).__name__,
            "partitioned_at_load": partitioned_at_load, "is_rank0": trainer.is_world_process_zero()}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--report", required=True)
    p.add_argument("--deepspeed", nargs="*", default=[None])
    p.add_argument("--resume_from_step", type=int, default=None)
    p.add_argument("--max_steps", type=int, default=5)
    p.add_argument("--save_steps", type=int, default=3)
    p.add_argument("--grad_accum", type=int, default=1)
    p.add_argument("--local_rank", type=int, default=-1)
    a = p.parse_args()

    report = {}
    for cfg in a.deepspeed:
        cfg = None if cfg in (None, "none") else cfg  # "none": plain DDP
        name = os.path.splitext(os.path.basename(cfg))[0] if cfg else "ddp"
        out = os.path.join(a.out, name)
        kw = dict(max_steps=a.max_steps, save_steps=a.save_steps, grad_accum=a.grad_accum)
        report[name] = train(a.model, out, cfg, None, **kw)
        if a.resume_from_step and cfg is not None:
            resumed = os.path.join(out, f"checkpoint-{a.resume_from_step}")
            report[name + "-resume"] = train(a.model, out + "-resume", cfg, resumed, **kw)
    if report[name]["is_rank0"]:
        with open(a.report, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
