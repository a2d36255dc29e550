"""The Hugging Face ``Trainer`` cells of tests/finetune_matrix.py, as a fine-tuning framework runs them.

    python -m shardwise run --num_gpus 2 finetune_matrix_trainer.py --cells CELLS.json --out DIR --report FILE
    python finetune_matrix_trainer.py --reference --cells CELLS.json --out DIR --report FILE

For each cell: ``TrainingArguments(deepspeed=<config>, use_cpu=True, gradient_checkpointing=...)``, the tiny
model loaded with ``from_pretrained`` after them (under ZeRO-3 inside ``zero.Init``), LoRA applied with peft
afterwards, ``Trainer(...).train()``. ``--reference``: one process, no DeepSpeed, the per-device batch
doubled (the 2 ranks' batches together); it also saves the tiny models the other run loads. The report
holds, per cell, the logged losses and the trained trainable parameters (gathered).
"""
import argparse
import json
import os
import sys
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from finetune_matrix import HIDDEN, LORA_TARGETS, LR, MICRO, SEQ, STEPS, VOCAB  # noqa: E402


class TokenData(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(11)
        self.ids = torch.randint(3, VOCAB, (n, SEQ), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def save_models(folder: str) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    for shape in ("mha", "gqa", "tied"):
        path = os.path.join(folder, shape)
        if os.path.isdir(path):
            continue
        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2 if shape == "gqa" else 4,
                             max_position_embeddings=32, tie_word_embeddings=shape == "tied", use_cache=False)
        LlamaForCausalLM(config).save_pretrained(path)


def train(cell: dict, models: str, out: str, reference: bool) -> dict:
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    ckpt = cell["ckpt"]
    args = TrainingArguments(
        output_dir=out, per_device_train_batch_size=MICRO * (2 if reference else 1),
        gradient_accumulation_steps=cell["gas"], max_steps=STEPS, learning_rate=LR, weight_decay=0.01,
        lr_scheduler_type="constant", logging_steps=1, save_strategy="no", report_to=[], use_cpu=True,
        deepspeed=None if reference else json.loads(json.dumps(cell["ds"])), seed=7, disable_tqdm=True,
        gradient_checkpointing=ckpt in ("reentrant", "nonreentrant"),
        gradient_checkpointing_kwargs={"use_reentrant": ckpt == "reentrant"})
    model = AutoModelForCausalLM.from_pretrained(os.path.join(models, cell["shape"]))  # (zero.Init at ZeRO-3)
    if ckpt == "swckpt":  # DeepSpeed's activation checkpointing API as the layers' checkpoint function
        import deepspeed

        model.activation_checkpointing_enable()
        model._set_gradient_checkpointing(True, deepspeed.checkpointing.checkpoint)
    if cell["tuning"] != "full":
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(1)
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=LORA_TARGETS,
                                                 modules_to_save=["lm_head"] if cell["tuning"] == "mts" else None))
    trainer = Trainer(model=model, args=args, train_dataset=TokenData(STEPS * cell["gas"] * 2 * MICRO))
    trainer.train()
    logs = [r for r in trainer.state.log_history if "loss" in r]
    named = [(n, p) for n, p in trainer.model.named_parameters() if p.requires_grad]
    from shardwise.zero import GatheredParameters

    with GatheredParameters([p for _, p in named]):
        params = {n.replace("module.", "", 1): p.detach().cpu().tolist() for n, p in named}
    return {"steps": trainer.state.global_step, "loss": [r["loss"] for r in logs], "params": params,
            "engine": type(trainer.model_wrapped).__module__ + "." + type(trainer.model_wrapped).__name__,
            "rank0": trainer.is_world_process_zero()}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--cells", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--report", required=True)
    p.add_argument("--reference", action="store_true")
    p.add_argument("--local_rank", type=int, default=-1)
    a = p.parse_args()
    models = os.path.join(os.path.dirname(a.out), "models")
    if a.reference:
        save_models(models)
    report, rank0 = {}, True
    for cell in json.load(open(a.cells)):
        try:
            report[cell["name"]] = train(cell, models, os.path.join(a.out, cell["name"]), a.reference)
            rank0 = report[cell["name"]]["rank0"]
        except Exception:
            report[cell["name"]] = {"error": traceback.format_exc()[-4000:]}
    if rank0 and int(os.environ.get("RANK", "0")) == 0:
        with open(a.report, "w") as f:
            json.dump(report, f)


if __name__ == "__main__":
    main()
