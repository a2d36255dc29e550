"""TRL's SFTTrainer as a second client of the ``deepspeed`` compatibility package (needs ``pip install trl``).

    deepspeed --num_gpus 2 examples/hf_trainer/sft_trl.py --model tiny-model --data examples/chat/train.json \\
        --deepspeed examples/hf_trainer/ds_config.json --output_dir sft-out

Each chat record's prompt and response become one training text. Without --deepspeed it runs on plain
DDP: in fp32 (``--bf16`` off, the default here) both give the same losses.
"""
import argparse
import json

from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import SFTConfig, SFTTrainer


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--output_dir", required=True)
    p.add_argument("--deepspeed", default=None)
    p.add_argument("--max_steps", type=int, default=4)
    p.add_argument("--bf16", action="store_true", help="bf16 weights under DeepSpeed; CPU autocast under DDP")
    p.add_argument("--local_rank", type=int, default=-1)
    a = p.parse_args()
    args = SFTConfig(output_dir=a.output_dir, per_device_train_batch_size=2, max_steps=a.max_steps, logging_steps=1,
                     learning_rate=1e-2, max_length=64, use_cpu=True, deepspeed=a.deepspeed, bf16=a.bf16,
                     report_to=[], save_strategy="no", seed=3, disable_tqdm=True)
    model = AutoModelForCausalLM.from_pretrained(a.model)  # after the config: zero.Init under ZeRO-3
    tokenizer = AutoTokenizer.from_pretrained(a.model)
    with open(a.data, encoding="utf-8") as f:
        records = [json.loads(line) for line in f if line.strip()]
    data = Dataset.from_list([{"text": r["prompt"] + "\n" + r["response"]} for r in records])
    trainer = SFTTrainer(model=model, args=args, train_dataset=data, processing_class=tokenizer)
    trainer.train()
    trainer.save_model()


if __name__ == "__main__":
    main()
