"""Fill a DeepSpeed config from fine-tuning flags, the way the Hugging Face Trainer does.

A value the config leaves out or sets to ``"auto"`` is taken from the matching flag; a value the
config sets explicitly wins, unless the flag was also given with a different value, which is an
error naming both (silently training with a batch size or learning rate the user did not
expect is worse than stopping).
"""
from __future__ import annotations

import argparse
import copy
import json
import math
from typing import Any

__all__ = ["build_config", "DEFAULT_LR", "DEFAULT_MICRO_BATCH"]

DEFAULT_LR = 5e-5
DEFAULT_MICRO_BATCH = 8


def _is_unset(block: dict, key: str) -> bool:
    return key not in block or block[key] == "auto"


def _source(args: argparse.Namespace) -> str:
    """How errors name the config: its file, when it came from one."""
    path = getattr(args, "deepspeed", None)
    return f"the config {path} (--deepspeed)" if path else "the config"


def _merge(block: dict, key: str, flag: str, flag_value: Any, default: Any, where: str, source: str) -> None:
    """Set ``block[key]`` from the flag (or the default) unless the config already has it."""
    if _is_unset(block, key):
        block[key] = default if flag_value is None else flag_value
    elif flag_value is not None and block[key] != flag_value:
        raise ValueError(f"{where}{key} is {block[key]!r} in {source} but {flag} is {flag_value!r}: "
                         f"drop one of them or set the config value to \"auto\"")


def _learning_rate(value: Any, where: str, source: str) -> float:
    """``value`` as a learning rate, or ValueError naming the key and the file."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
        raise ValueError(f"{where} in {source} must be a number >= 0 (or \"auto\"), got {value!r}")
    return float(value)


def load_json(path: str | None) -> dict:
    if path is None:
        return {}
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"--deepspeed: config file not found: {path}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"--deepspeed: {path}:{exc.lineno}: not valid JSON ({exc.msg})") from None
    if not isinstance(data, dict):
        raise ValueError(f"--deepspeed: {path} must hold a JSON object")
    return data


def build_config(raw: dict, args: argparse.Namespace, *, total_steps: int) -> dict:
    """The config dict to pass to ``shardwise.initialize`` (``raw`` is not modified)."""
    cfg = copy.deepcopy(raw)
    source = _source(args)
    _merge(cfg, "train_micro_batch_size_per_gpu", "--per_device_train_batch_size",
           args.per_device_train_batch_size, DEFAULT_MICRO_BATCH, "", source)
    _merge(cfg, "gradient_accumulation_steps", "--gradient_accumulation_steps",
           args.gradient_accumulation_steps, 1, "", source)
    if cfg.get("train_batch_size") == "auto":
        del cfg["train_batch_size"]
    if _is_unset(cfg, "gradient_clipping"):
        cfg["gradient_clipping"] = args.max_grad_norm
    _precision(cfg, args)
    lr = _optimizer(cfg, args)
    _scheduler(cfg, args, lr, total_steps)
    return cfg


def _precision(cfg: dict, args: argparse.Namespace) -> None:
    for key, flag, on in (("fp16", "--fp16", args.fp16), ("bf16", "--bf16", args.bf16)):
        block = cfg.setdefault(key, {})
        if _is_unset(block, "enabled"):
            block["enabled"] = on
        elif on and not block["enabled"]:
            raise ValueError(f"{key}.enabled is false in {_source(args)} but {flag} was given")


def _optimizer(cfg: dict, args: argparse.Namespace) -> float:
    opt = cfg.get("optimizer")
    if opt is None:
        lr = args.learning_rate if args.learning_rate is not None else DEFAULT_LR
        cfg["optimizer"] = {"type": "AdamW", "params": {"lr": lr, "weight_decay": args.weight_decay,
                                                         "betas": [0.9, 0.999], "eps": 1e-8}}
        return lr
    params = opt.setdefault("params", {})
    source = _source(args)
    if not _is_unset(params, "lr"):
        _learning_rate(params["lr"], "optimizer.params.lr", source)
    _merge(params, "lr", "--learning_rate", args.learning_rate, DEFAULT_LR, "optimizer.params.", source)
    if _is_unset(params, "weight_decay"):
        params["weight_decay"] = args.weight_decay
    return float(params["lr"])


def _scheduler(cfg: dict, args: argparse.Namespace, lr: float, total_steps: int) -> None:
    warmup = args.warmup_steps
    sched = cfg.get("scheduler")
    if sched is not None:
        params = sched.setdefault("params", {})
        fills = {"total_num_steps": total_steps, "warmup_num_steps": max(warmup, 1), "warmup_max_lr": lr,
                 "warmup_min_lr": 0.0}
        for key, value in fills.items():
            if params.get(key) == "auto":
                params[key] = value
        for key in ("warmup_min_lr", "warmup_max_lr", "cycle_min_lr", "cycle_max_lr", "lr_range_test_min_lr"):
            if key in params:
                _learning_rate(params[key], f"scheduler.params.{key}", _source(args))
        return
    # DeepSpeed's schedules warm up over at least 2 steps; without warm-up, start at the peak.
    if args.lr_scheduler_type == "constant":
        if warmup:
            cfg["scheduler"] = {"type": "WarmupLR", "params": {
                "warmup_min_lr": 0.0, "warmup_max_lr": lr, "warmup_num_steps": warmup, "warmup_type": "linear"}}
    elif args.lr_scheduler_type == "linear":
        cfg["scheduler"] = {"type": "WarmupDecayLR", "params": {
            "total_num_steps": total_steps, "warmup_min_lr": 0.0 if warmup else lr, "warmup_max_lr": lr,
            "warmup_num_steps": max(warmup, 1), "warmup_type": "linear"}}
    else:
        cfg["scheduler"] = {"type": "WarmupCosineLR", "params": {
            "total_num_steps": total_steps, "warmup_min_ratio": 0.0 if warmup else 1.0,
            "warmup_num_steps": max(warmup, 1), "cos_min_ratio": 0.0, "warmup_type": "linear"}}
