"""Fine-tune a causal LM on prompt/response/history chat data with Hugging Face's Seq2SeqTrainer.

A DeepSpeed user's script, shaped like the ChatGLM P-Tuning ``main.py``: nothing in it
names shardwise. Launched the DeepSpeed way it runs on shardwise through the ``deepspeed``
compatibility package (``pip install ./compat/deepspeed``; docs/hf-trainer.md)::

    deepspeed --num_gpus 2 examples/hf_trainer/main.py --deepspeed examples/hf_trainer/ds_config.json \\
        --do_train --train_file examples/chat/train.json --prompt_column prompt --response_column response \\
        --history_column history --model_name_or_path tiny-model --output_dir out --max_steps 20 --use_cpu

Conversations are rendered with the round template (``[Round 1]\\n\\n问：...\\n\\n答：...``), which is
what ``shardwise serve`` uses for a tokenizer without a chat template, so the saved folder serves as is.
"""
from __future__ import annotations

import json
import logging
import os
import sys
from dataclasses import dataclass, field

import torch
from transformers import (AutoModelForCausalLM, AutoTokenizer, DataCollatorForSeq2Seq, HfArgumentParser,
                          Seq2SeqTrainer, Seq2SeqTrainingArguments, set_seed)

logger = logging.getLogger(__name__)


@dataclass
class ModelArguments:
    model_name_or_path: str = field(metadata={"help": "a local model folder (config, weights, tokenizer)"})


@dataclass
class DataTrainingArguments:
    train_file: str = field(metadata={"help": "JSON lines (or a JSON array) of chat records"})
    prompt_column: str = "prompt"
    response_column: str = "response"
    history_column: str | None = "history"
    max_source_length: int = 256
    max_target_length: int = 128
    ignore_pad_token_for_loss: bool = True


def read_records(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if text.lstrip().startswith("["):
        return json.loads(text)
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def build_prompt(query: str, history: list) -> str:
    """ChatGLM's round template: earlier turns, then the current question and an open answer."""
    prompt = "".join(f"[Round {i + 1}]\n\n问：{q}\n\n答：{a}\n\n" for i, (q, a) in enumerate(history or []))
    return prompt + f"[Round {len(history or []) + 1}]\n\n问：{query}\n\n答："


class ChatDataset(torch.utils.data.Dataset):
    """Prompt tokens are masked out of the labels (-100): only the response and EOS are learned."""

    def __init__(self, records, tokenizer, data_args: DataTrainingArguments) -> None:
        self.samples = []
        for r in records:
            history = r.get(data_args.history_column) if data_args.history_column else None
            source = tokenizer(build_prompt(r[data_args.prompt_column], history))["input_ids"]
            target = tokenizer(r[data_args.response_column], add_special_tokens=False)["input_ids"]
            source = source[-data_args.max_source_length:]
            target = target[:data_args.max_target_length - 1] + [tokenizer.eos_token_id]
            ids = source + target
            self.samples.append({"input_ids": ids, "attention_mask": [1] * len(ids),
                                 "labels": [-100] * len(source) + target})

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i):
        return self.samples[i]


def main() -> None:
    parser = HfArgumentParser((ModelArguments, DataTrainingArguments, Seq2SeqTrainingArguments))
    if len(sys.argv) == 2 and sys.argv[1].endswith(".json"):
        model_args, data_args, training_args = parser.parse_json_file(os.path.abspath(sys.argv[1]))
    else:
        model_args, data_args, training_args = parser.parse_args_into_dataclasses()
    logging.basicConfig(format="%(asctime)s - %(levelname)s - %(name)s - %(message)s",
                        level=training_args.get_process_log_level())
    set_seed(training_args.seed)

    tokenizer = AutoTokenizer.from_pretrained(model_args.model_name_or_path)
    # loaded after the training arguments: under ZeRO-3 it is built partitioned (deepspeed.zero.Init)
    model = AutoModelForCausalLM.from_pretrained(model_args.model_name_or_path)
    with training_args.main_process_first(desc="tokenizing"):
        train_dataset = ChatDataset(read_records(data_args.train_file), tokenizer, data_args)
    collator = DataCollatorForSeq2Seq(tokenizer, model=model, padding=True,
                                      label_pad_token_id=-100 if data_args.ignore_pad_token_for_loss
                                      else tokenizer.pad_token_id)
    trainer = Seq2SeqTrainer(model=model, args=training_args, train_dataset=train_dataset,
                             processing_class=tokenizer, data_collator=collator)
    if training_args.do_train:
        result = trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
        trainer.save_model()  # weights, config and tokenizer in --output_dir: loads with from_pretrained
        trainer.log_metrics("train", result.metrics)
        trainer.save_metrics("train", result.metrics)
        trainer.save_state()


if __name__ == "__main__":
    main()
