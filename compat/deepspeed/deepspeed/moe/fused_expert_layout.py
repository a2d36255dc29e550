"""``deepspeed.moe.fused_expert_layout``: DeepSpeed's classifier of fused gate/up expert weights by shape.

Two layouts of a fused expert pair (``w1``: gate and up projections stacked, ``w2``: down projection,
both ``[num_experts, ., .]``) are told apart:

- ``gate_up_first``: ``w1`` is ``[E, 2 * ffn, hidden]`` and ``w2`` ``[E, hidden, ffn]`` (Hugging Face's
  ``gate_up_proj`` / ``down_proj`` of Mixtral, Qwen-MoE, DeepSeek; what shardwise's AutoEP reads);
- ``hidden_first``: ``w1`` is ``[E, hidden, 2 * ffn]`` and ``w2`` ``[E, ffn, hidden]`` (the transposed
  storage, ``needs_transpose``).

Anything else (not 3-D, an odd fused dimension, shapes that do not pair up) is ``None``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

FusedLayout = Literal["gate_up_first", "hidden_first"]

__all__ = ["FusedExpertLayout", "FusedLayout", "classify_fused_gate_up_layout"]


@dataclass(frozen=True)
class FusedExpertLayout:
    layout: FusedLayout
    hidden_size: int
    ffn_hidden_size: int
    needs_transpose: bool


def classify_fused_gate_up_layout(w1_shape: tuple[int, ...], w2_shape: tuple[int, ...]) -> Optional[FusedExpertLayout]:
    """The layout of fused expert weights of shapes ``w1_shape`` (gate + up) and ``w2_shape`` (down)."""
    w1, w2 = tuple(w1_shape), tuple(w2_shape)
    if len(w1) != 3 or len(w2) != 3:
        return None
    _, a, b = w1
    if a % 2 == 0 and w2[1:] == (b, a // 2):
        return FusedExpertLayout("gate_up_first", hidden_size=b, ffn_hidden_size=a // 2, needs_transpose=False)
    if b % 2 == 0 and w2[1:] == (b // 2, a):
        return FusedExpertLayout("hidden_first", hidden_size=a, ffn_hidden_size=b // 2, needs_transpose=True)
    return None
