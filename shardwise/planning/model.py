"""The model a plan is made for, built on the meta device (shapes only, no weights).

``--model`` is either a folder holding a Hugging Face ``config.json`` (built with ``transformers``'
``AutoModelForCausalLM.from_config``) or the reference GPT (``shardwise.models.gpt``) as
``gpt:hidden=1024,n_layers=24,n_heads=16,vocab_size=50304,seq_len=2048``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, fields

import torch


@dataclass(frozen=True)
class ModelShape:
    """What the activation, FLOPs and communication arithmetic needs to know of a transformer."""

    kind: str  # "gpt" or "hf"
    name: str
    num_layers: int
    hidden: int
    heads: int
    kv_heads: int
    vocab: int
    ffn: int
    seq_len: int
    num_experts: int = 0
    experts_per_token: int = 0


def parse_model_arg(arg: str) -> tuple[str, object]:
    """``("gpt", GPTConfig)`` or ``("hf", transformers config)``; a clear error for anything else."""
    if arg.startswith("gpt"):
        from shardwise.models.gpt import GPTConfig

        known = {f.name: f.type for f in fields(GPTConfig)}
        values = {}
        body = arg[3:].lstrip(":")
        for item in filter(None, body.split(",")):
            key, _, value = item.partition("=")
            if key not in known or not value:
                raise ValueError(f"--model {arg}: '{item}' is not KEY=VALUE of a GPTConfig field "
                                 f"({', '.join(known)})")
            try:
                values[key] = float(value) if key == "dropout" else (value.lower() in ("1", "true")
                                                                      if key == "sequence_parallel" else int(value))
            except ValueError:
                raise ValueError(f"--model {arg}: '{item}' is not KEY=VALUE with a number") from None
        return "gpt", GPTConfig(**values)
    path = arg
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"--model {arg}: neither a folder with a config.json, a config.json, nor gpt:KEY=VALUE,...")
    try:
        from transformers import AutoConfig
    except ImportError as exc:  # pragma: no cover - transformers is a dev dependency
        raise ValueError("--model with a Hugging Face config needs transformers (pip install transformers)") from exc
    with open(path) as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--model {arg}: {path} is not JSON ({exc})") from None
    if not isinstance(data, dict) or "model_type" not in data:
        raise ValueError(f"--model {arg}: {path} has no model_type (a Hugging Face config.json names its family, "
                         "e.g. \"model_type\": \"llama\")")
    try:
        return "hf", AutoConfig.for_model(data.pop("model_type"), **data)  # no hub, no download
    except ValueError as exc:
        raise ValueError(f"--model {arg}: {exc}") from None


def hf_shape(config, seq_len: int | None) -> ModelShape:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    hidden = int(text.hidden_size)
    heads = int(text.num_attention_heads)
    return ModelShape(
        kind="hf", name=type(text).__name__.replace("Config", ""), num_layers=int(text.num_hidden_layers),
        hidden=hidden, heads=heads, kv_heads=int(getattr(text, "num_key_value_heads", None) or heads),
        vocab=int(text.vocab_size), ffn=int(getattr(text, "intermediate_size", None) or 4 * hidden),
        seq_len=int(seq_len or min(int(getattr(text, "max_position_embeddings", 4096) or 4096), 4096)),
        num_experts=int(getattr(text, "num_experts", None) or getattr(text, "num_local_experts", None) or 0),
        experts_per_token=int(getattr(text, "num_experts_per_tok", None) or 0))


def gpt_shape(cfg, seq_len: int | None) -> ModelShape:
    return ModelShape(kind="gpt", name="GPT", num_layers=cfg.n_layers, hidden=cfg.hidden, heads=cfg.n_heads,
                      kv_heads=cfg.n_heads, vocab=cfg.vocab_size, ffn=cfg.mlp_ratio * cfg.hidden,
                      seq_len=int(seq_len or cfg.seq_len))


def build_hf_meta(config) -> torch.nn.Module:
    """The causal LM of ``config`` on the meta device (no memory, no initialisation)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)
