"""Command-line flags of ``shardwise finetune`` and ``shardwise serve``.

Kept free of heavy imports (no torch, no transformers) so ``shardwise --help`` stays fast.
Flag names follow the Hugging Face example scripts (ChatGLM's ``ptuning/main.py``) so existing
command lines keep working.
"""
from __future__ import annotations

import argparse

__all__ = ["add_finetune_arguments", "add_serve_arguments", "check_finetune_arguments"]


def add_finetune_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = parser.add_argument_group("model")
    g.add_argument("--model_name_or_path", required=True, metavar="DIR",
                   help="local folder of a Hugging Face causal LM (config, weights, tokenizer)")
    g.add_argument("--trust_remote_code", action="store_true",
                   help="allow the model folder's own Python code (ChatGLM-style models need it)")
    g.add_argument("--gradient_checkpointing", action="store_true", help="recompute activations in backward")
    g.add_argument("--lora_r", type=int, default=0, metavar="R", help="LoRA rank; 0 (default) = full fine-tuning")
    g.add_argument("--lora_alpha", type=float, default=16.0, help="LoRA scaling numerator (default %(default)s)")
    g.add_argument("--lora_dropout", type=float, default=0.05, help="LoRA dropout (default %(default)s)")
    g.add_argument("--lora_target_modules", default="all-linear", metavar="NAMES",
                   help="comma-separated module names to adapt, or 'all-linear' (default)")
    g.add_argument("--merge_lora", action="store_true",
                   help="save a full model with the adapter merged in, instead of the adapter alone")

    g = parser.add_argument_group("data")
    g.add_argument("--train_file", required=True, metavar="FILE", help="JSON-lines or JSON-array training data")
    g.add_argument("--validation_file", metavar="FILE", help="data for evaluation loss and --predict_with_generate")
    g.add_argument("--prompt_column", default="prompt", help="key of the prompt (default %(default)s)")
    g.add_argument("--response_column", default="response", help="key of the response (default %(default)s)")
    g.add_argument("--history_column", default=None,
                   help="key of the [[query, answer], ...] history (default: the data has no history)")
    g.add_argument("--max_source_length", type=int, default=1024, help="prompt tokens kept (default %(default)s)")
    g.add_argument("--max_target_length", type=int, default=128,
                   help="response tokens kept, EOS included (default %(default)s)")
    g.add_argument("--prompt_template", choices=["auto", "chat", "round"], default="auto",
                   help="auto: the tokenizer's chat template if it has one, else the round template")
    g.add_argument("--skip_bad_lines", action="store_true", help="skip and count malformed records instead of failing")
    g.add_argument("--max_record_bytes", type=int, default=1 << 20, metavar="N",
                   help="a data record (a JSON line, or an element of a JSON array) longer than this is a bad "
                   "record (default %(default)s: 1 MiB)")
    g.add_argument("--data_cache_dir", default=None, metavar="DIR",
                   help="where tokenised data is cached (default ~/.cache/shardwise/chat_data)")
    g.add_argument("--preprocessing_num_workers", type=int, default=1, metavar="N",
                   help="tokenising processes per rank (default %(default)s)")
    g.add_argument("--dataloader_num_workers", type=int, default=0, metavar="N")

    g = parser.add_argument_group("training")
    g.add_argument("--deepspeed", "--deepspeed_config", dest="deepspeed", metavar="JSON",
                   help="DeepSpeed-format config; 'auto' values are filled from these flags")
    g.add_argument("--output_dir", required=True, metavar="DIR",
                   help="where the final model, checkpoints, logs and predictions go")
    g.add_argument("--per_device_train_batch_size", type=int, default=None, metavar="N",
                   help="micro-batch per process (default: the config's, else 8)")
    g.add_argument("--per_device_eval_batch_size", type=int, default=None, metavar="N")
    g.add_argument("--gradient_accumulation_steps", type=int, default=None, metavar="N")
    g.add_argument("--learning_rate", type=float, default=None, help="peak learning rate (default 5e-5)")
    g.add_argument("--weight_decay", type=float, default=0.0)
    g.add_argument("--max_grad_norm", type=float, default=1.0, help="gradient clipping when the config has none")
    g.add_argument("--lr_scheduler_type", choices=["linear", "cosine", "constant"], default="linear")
    g.add_argument("--warmup_steps", type=int, default=0)
    g.add_argument("--max_steps", type=int, default=-1, help="optimizer steps; overrides --num_train_epochs")
    g.add_argument("--num_train_epochs", type=float, default=3.0)
    g.add_argument("--logging_steps", type=int, default=10)
    g.add_argument("--save_steps", type=int, default=500, help="engine checkpoint every N steps (0: never)")
    g.add_argument("--eval_steps", type=int, default=0, help="evaluation loss every N steps (0: at the end only)")
    g.add_argument("--predict_with_generate", action="store_true",
                   help="at the end, generate answers for the validation set and score them")
    g.add_argument("--max_predict_samples", type=int, default=None, metavar="N")
    g.add_argument("--resume_from_checkpoint", default=None, metavar="DIR",
                   help="a checkpoint folder (with 'latest'), one tag inside it, or 'auto' for OUTPUT_DIR/checkpoints")
    g.add_argument("--seed", type=int, default=42)
    prec = g.add_mutually_exclusive_group()
    prec.add_argument("--fp16", action="store_true", help="fp16 weights with loss scaling")
    prec.add_argument("--bf16", action="store_true", help="bf16 weights")
    return parser


def check_finetune_arguments(args: argparse.Namespace) -> None:
    """Raise ValueError naming the flag for values that cannot work."""
    positive = ["max_source_length", "max_target_length", "logging_steps", "preprocessing_num_workers",
                "max_record_bytes"]
    for name in positive:
        if getattr(args, name) < 1:
            raise ValueError(f"--{name} must be at least 1, got {getattr(args, name)}")
    for name in ["per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps"]:
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name} must be at least 1, got {value}")
    for name in ["save_steps", "eval_steps", "warmup_steps", "lora_r", "dataloader_num_workers"]:
        if getattr(args, name) < 0:
            raise ValueError(f"--{name} must be 0 or more, got {getattr(args, name)}")
    if args.max_steps <= 0 and args.num_train_epochs <= 0:
        raise ValueError("give --max_steps N or --num_train_epochs E (both are <= 0)")
    if args.merge_lora and not args.lora_r:
        raise ValueError("--merge_lora needs LoRA: set --lora_r")
    if args.predict_with_generate and not args.validation_file:
        raise ValueError("--predict_with_generate needs --validation_file")


def add_serve_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--model", required=True, metavar="DIR",
                        help="model folder (a fine-tuned output_dir, or a LoRA adapter folder)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default %(default)s)")
    parser.add_argument("--port", type=int, default=8000, help="port (default %(default)s)")
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ... or auto (default %(default)s)")
    parser.add_argument("--dtype", default="float32", choices=["auto", "float32", "float16", "bfloat16"],
                        help="weights dtype for inference (default %(default)s)")
    parser.add_argument("--trust_remote_code", action="store_true")
    parser.add_argument("--prompt_template", choices=["auto", "chat", "round"], default="auto",
                        help="must match the one used for fine-tuning (default %(default)s)")
    parser.add_argument("--max_batch_size", "--max_concurrency", dest="max_batch_size", type=int, default=8,
                        metavar="N", help="requests generated together in one decoding step; 1 generates one at "
                        "a time (default %(default)s; --max_concurrency is the older name)")
    parser.add_argument("--max_queue", type=int, default=32, metavar="N",
                        help="requests allowed to wait; more get 503 (default %(default)s)")
    parser.add_argument("--max_length", type=int, default=None, metavar="N",
                        help="default prompt+answer token limit (default: the model's context length)")
    parser.add_argument("--max_new_tokens", type=int, default=512, metavar="N",
                        help="upper bound on answer tokens per request (default %(default)s)")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="default temperature; 0 means greedy decoding (default %(default)s)")
    parser.add_argument("--top_p", type=float, default=1.0, help="default nucleus sampling mass (default %(default)s)")
    parser.add_argument("--request_timeout", type=float, default=300.0, metavar="SECONDS",
                        help="a request not answered within this time gets 504 (default %(default)s)")
    parser.add_argument("--max_body_bytes", type=int, default=None, metavar="N",
                        help="larger request bodies get 413 before they are parsed (default: 12 bytes per "
                        "character of --max_prompt_chars plus 64 KiB, at most 4 MiB)")
    parser.add_argument("--max_prompt_chars", type=int, default=None, metavar="N",
                        help="prompts (with history) longer than this get 400 before they are tokenised "
                        "(default: 16 per token of --max_length, or of the model's context)")
    parser.add_argument("--body_timeout", type=float, default=30.0, metavar="SECONDS",
                        help="a request body not fully received this long after its headers gets 408 "
                        "(default %(default)s)")
    parser.add_argument("--header_timeout", type=float, default=10.0, metavar="SECONDS",
                        help="a connection that has not sent complete request headers this long after opening "
                        "(or after its previous response) gets 408 and is closed (default %(default)s)")
    parser.add_argument("--keep_alive_timeout", type=float, default=5.0, metavar="SECONDS",
                        help="an idle keep-alive connection is closed after this long (uvicorn's "
                        "timeout_keep_alive; default %(default)s)")
    parser.add_argument("--max_connections", type=int, default=256, metavar="N",
                        help="open connections allowed; one more gets 503 and is closed at once "
                        "(default %(default)s)")
    parser.add_argument("--max_header_bytes", type=int, default=16 * 1024, metavar="N",
                        help="request headers larger than this get 400 (uvicorn's h11_max_incomplete_event_size; "
                        "default %(default)s)")
    parser.add_argument("--api_key", default=None, metavar="KEY",
                        help="require 'Authorization: Bearer KEY' on every request (401 otherwise); also read "
                        "from $SHARDWISE_API_KEY. Set it whenever --host is not 127.0.0.1")
    parser.add_argument("--served_model_name", default=None, metavar="NAME",
                        help="the base model's name in the OpenAI API (the 'model' field, GET /v1/models); "
                        "default: the --model folder's name")
    parser.add_argument("--lora_modules", nargs="+", default=[], metavar="NAME=DIR",
                        help="LoRA adapter folders (as shardwise finetune --lora_r writes them) served over the "
                        "base model; a request picks one by its 'model' field, and requests for different "
                        "adapters and the base are batched together")
    parser.add_argument("--kv_cache", default="paged", choices=["paged", "padded"],
                        help="KV cache layout: paged blocks with prefix caching, or per-request caches "
                        "left-padded and stacked (default %(default)s)")
    parser.add_argument("--kv_cache_bytes", type=int, default=None, metavar="N",
                        help="memory for the paged KV cache; requests wait when it is full (default: room for "
                        "--max_batch_size sequences of the model's whole context)")
    parser.add_argument("--kv_block_size", type=int, default=16, metavar="TOKENS",
                        help="tokens per block of the paged KV cache (default %(default)s)")
    parser.add_argument("--log_level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    return parser
