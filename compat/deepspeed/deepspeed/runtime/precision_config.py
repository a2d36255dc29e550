"""``deepspeed.runtime.precision_config``: the ``fp16`` and ``bf16`` blocks under DeepSpeed's class names,
validated by shardwise's models of them (shardwise.config.precision)."""
from __future__ import annotations

from shardwise.config.precision import BF16Config, FP16Config

from .._config_view import ConfigView


class DeepSpeedFP16Config(ConfigView):
    model = FP16Config
    where = "fp16"

    def __init__(self, **data) -> None:
        # DeepSpeed's class reads loss_scale with float(value), so a numeric string ("3") is a scale there. The
        # config shardwise loads keeps its one type rule (docs/config.md): a string is refused there, by name.
        value = data.get("loss_scale")
        if isinstance(value, str) and value.strip() != "auto":
            try:
                data["loss_scale"] = float(value)
            except ValueError:
                pass  # not a number: refused below as "must be a number"
        super().__init__(**data)


class DeepSpeedBF16Config(ConfigView):
    model = BF16Config
    where = "bf16"


def get_bfloat16_config(param_dict: dict) -> DeepSpeedBF16Config:
    """The ``bf16`` block (or its older name ``bfloat16``) of a config dict."""
    return DeepSpeedBF16Config(**(param_dict.get("bf16", param_dict.get("bfloat16")) or {}))


def get_float16_config(param_dict: dict) -> DeepSpeedFP16Config:
    return DeepSpeedFP16Config(**(param_dict.get("fp16") or {}))


__all__ = ["DeepSpeedBF16Config", "DeepSpeedFP16Config", "get_bfloat16_config", "get_float16_config"]
