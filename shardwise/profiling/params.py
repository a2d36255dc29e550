"""Parameter sizes that stay right when ZeRO stage 3 has partitioned the parameters."""

from __future__ import annotations

import torch


def full_numel(p: torch.Tensor) -> int:
    """Elements of the whole parameter: a stage-3 parameter holds only its shard (``p._sw``)."""
    meta = getattr(p, "_sw", None)
    if meta is not None:
        return int(meta.numel)
    return int(getattr(p, "ds_numel", p.numel()))  # DeepSpeed-partitioned parameters


def count_parameters(model: torch.nn.Module, *, trainable_only: bool = True) -> int:
    return sum(full_numel(p) for p in model.parameters() if p.requires_grad or not trainable_only)
