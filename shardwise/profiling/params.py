"""Parameter sizes that stay right when ZeRO stage 3 has partitioned the parameters."""

from __future__ import annotations

import torch


def full_numel(p: torch.Tensor) -> int:
    """Elements of the whole parameter: a ZeRO-3 parameter holds only its shard (``ds_tensor``); it
    and a DeepSpeed-partitioned one say their whole size in ``ds_numel``."""
    return int(getattr(p, "ds_numel", p.numel()))


def count_parameters(model: torch.nn.Module, *, trainable_only: bool = True) -> int:
    return sum(full_numel(p) for p in model.parameters() if p.requires_grad or not trainable_only)
