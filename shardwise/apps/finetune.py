"""Fine-tune a local Hugging Face causal LM on prompt/response/history chat data.

    shardwise run --num_procs 2 -m shardwise.apps.finetune --deepspeed ds_config.json \\
        --train_file train.json --validation_file dev.json --history_column history \\
        --model_name_or_path MODEL_DIR --output_dir out --max_steps 1000 --learning_rate 1e-4

``shardwise finetune ...`` runs the same in the current process (a world of one, or the
world a launcher set up in the environment). See docs/finetune.md.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Sequence

from shardwise.apps.options import add_finetune_arguments, check_finetune_arguments

logger = logging.getLogger("shardwise")

__all__ = ["build_parser", "main", "run"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shardwise finetune", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the launcher")
    return add_finetune_arguments(parser)


def default_cache_dir() -> str:
    root = os.environ.get("SHARDWISE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "shardwise")
    return os.path.join(root, "chat_data")


def load_tokenizer(args):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path, trust_remote_code=args.trust_remote_code)
    if tokenizer.pad_token is None:  # padding is masked out of the loss; EOS is a safe filler
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model(args, *, partitioned: bool = False):
    """The model to fine-tune; ``partitioned`` (ZeRO stage 3) builds it sharded over the ranks."""
    import torch
    from transformers import AutoModelForCausalLM

    if partitioned:
        from shardwise.apps.weights import load_partitioned

        model = load_partitioned(args.model_name_or_path, trust_remote_code=args.trust_remote_code)
    else:
        model = AutoModelForCausalLM.from_pretrained(args.model_name_or_path, dtype=torch.float32,
                                                     trust_remote_code=args.trust_remote_code)
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    if args.lora_r:
        model = _apply_lora(model, args)
    return model


def _apply_lora(model, args):
    try:
        import peft
    except ImportError:
        raise ValueError("--lora_r needs the peft package: pip install 'shardwise[lora]'") from None
    if args.gradient_checkpointing:
        model.enable_input_require_grads()  # frozen embeddings would cut the checkpointed graph
    targets = args.lora_target_modules
    targets = targets if targets == "all-linear" else [t.strip() for t in targets.split(",") if t.strip()]
    config = peft.LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout,
                             target_modules=targets, task_type="CAUSAL_LM")
    try:
        return peft.get_peft_model(model, config)
    except ValueError as exc:
        raise ValueError(f"--lora_target_modules {args.lora_target_modules!r}: {exc}") from None


def _check_model_dir(path: str) -> None:
    if not os.path.isdir(path):
        raise ValueError(f"--model_name_or_path: {path} is not a folder (models are loaded from local folders "
                         "in the Hugging Face layout; nothing is downloaded)")


def _zero_stage(config: dict) -> int:
    zero_block = config.get("zero_optimization", 0)
    if isinstance(zero_block, bool):  # the deprecated `"zero_optimization": true` means stage 1
        return int(zero_block)
    return int(zero_block.get("stage", 0)) if isinstance(zero_block, dict) else 0


def _check_not_empty(path: str, flag: str, samples: int, skipped: int) -> None:
    if samples == 0:
        why = f"all {skipped} of its records were bad and skipped" if skipped else "it holds no records"
        raise ValueError(f"{path} ({flag}) has no usable samples: {why}")


def total_steps(args, num_samples: int, world: int, micro_batch: int, accumulation: int) -> int:
    if args.max_steps > 0:
        return args.max_steps
    batches = -(-(num_samples // world) // micro_batch)
    return max(1, int(args.num_train_epochs * batches / accumulation))


def export(engine, tokenizer, args) -> None:
    """Write a ``from_pretrained``-loadable model (or LoRA adapter) and the tokenizer to output_dir.

    Collective: every rank helps gather partitioned parameters; rank 0 writes. With
    ``--merge_lora`` the adapter goes to ``output_dir/adapter`` and the merged model to output_dir.
    """
    from shardwise import comm
    from shardwise.apps.weights import gathered_state_dict

    state = gathered_state_dict(engine.module)
    if comm.get_rank() == 0:
        target = os.path.join(args.output_dir, "adapter") if args.merge_lora else args.output_dir
        engine.module.save_pretrained(target, state_dict=state)
        tokenizer.save_pretrained(target)
        if args.merge_lora:
            from peft import AutoPeftModelForCausalLM

            merged = AutoPeftModelForCausalLM.from_pretrained(target).merge_and_unload()
            merged.save_pretrained(args.output_dir)
            tokenizer.save_pretrained(args.output_dir)
    comm.barrier()


def run(args: argparse.Namespace) -> dict:
    """Fine-tune as ``args`` say; returns a summary (rank 0 also prints and logs it)."""
    import torch
    from transformers.utils import logging as hf_logging

    import shardwise
    from shardwise import comm
    from shardwise.apps.ds_config import build_config, load_json
    from shardwise.apps.predict import predict
    from shardwise.apps.trainer import Trainer
    from shardwise.data import ChatCollator, ChatEncoder, Columns, load_chat_dataset

    check_finetune_arguments(args)
    _check_model_dir(args.model_name_or_path)
    hf_logging.disable_progress_bar()
    raw_config = load_json(args.deepspeed)
    shardwise.init_distributed()
    world = comm.get_world_size()
    os.makedirs(args.output_dir, exist_ok=True)
    torch.manual_seed(args.seed)

    tokenizer = load_tokenizer(args)
    encoder = ChatEncoder(tokenizer, max_source_length=args.max_source_length,
                          max_target_length=args.max_target_length, template=args.prompt_template)
    columns = Columns(args.prompt_column, args.response_column, args.history_column)
    data_kw = dict(encoder=encoder, cache_dir=args.data_cache_dir or default_cache_dir(), columns=columns,
                   skip_bad_lines=args.skip_bad_lines, workers=args.preprocessing_num_workers,
                   max_record_bytes=args.max_record_bytes)
    train_set, train_info = load_chat_dataset([args.train_file], **data_kw)
    _check_not_empty(args.train_file, "--train_file", len(train_set), train_info.skipped)
    eval_set = eval_info = None
    if args.validation_file:
        eval_set, eval_info = load_chat_dataset([args.validation_file], **data_kw)
        _check_not_empty(args.validation_file, "--validation_file", len(eval_set), eval_info.skipped)

    probe = build_config(raw_config, args, total_steps=1)  # micro-batch and accumulation are settled here
    steps = total_steps(args, len(train_set), world, int(probe["train_micro_batch_size_per_gpu"]),
                        int(probe["gradient_accumulation_steps"]))
    config = build_config(raw_config, args, total_steps=steps)
    model = load_model(args, partitioned=_zero_stage(config) == 3)
    trainable = [p for p in model.parameters() if p.requires_grad]
    engine, _, _, _ = shardwise.initialize(model=model, model_parameters=trainable, config=config)
    trainer = Trainer(engine, args, train_set=train_set, eval_set=eval_set,
                      collator=ChatCollator(tokenizer.pad_token_id), total_steps=steps)
    trainer.log({"train_samples": len(train_set), "train_cache": train_info.path, "cache_reused": train_info.reused,
                 "skipped_records": train_info.skipped, "eval_samples": len(eval_set) if eval_set else 0,
                 "template": encoder.template, "world_size": world, "total_steps": steps,
                 "global_batch": engine.train_batch_size(),
                 "trainable_parameters": sum(p.numel() for p in trainable)})
    if eval_info is not None and eval_info.skipped:
        trainer.log({"eval_skipped_records": eval_info.skipped})
    if args.resume_from_checkpoint:
        trainer.resume(args.resume_from_checkpoint)
    trainer.train()
    summary: dict = {"step": engine.global_steps, "final_loss": engine.get_loss()}
    if eval_set is not None:
        done_now = trainer.last_eval is not None and trainer.last_eval[0] == engine.global_steps
        summary["eval_loss"] = round(trainer.last_eval[1] if done_now else trainer.evaluate(), 6)
    if args.save_steps and engine.global_steps % args.save_steps:
        trainer.save_checkpoint()
    export(engine, tokenizer, args)
    if args.predict_with_generate:
        scores = predict(engine, tokenizer, eval_set, output_dir=args.output_dir,
                         max_new_tokens=args.max_target_length, max_samples=args.max_predict_samples)
        if scores is not None:
            summary["predict"] = scores
    trainer.log({"done": True, **summary, "output_dir": args.output_dir})
    return summary


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        run(args)
    except ValueError as exc:  # a user mistake: say what and where, no traceback
        print(f"shardwise finetune: error: {exc}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
