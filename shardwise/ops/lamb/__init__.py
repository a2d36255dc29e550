"""``deepspeed.ops.lamb``: FusedLamb."""

from .fused_lamb import FusedLamb

__all__ = ["FusedLamb"]
