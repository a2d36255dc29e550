"""``deepspeed.ops.lion.fused_lion.FusedLion``: Lion with DeepSpeed's arguments, any device."""

from __future__ import annotations

from shardwise.optim.lion import Lion


class FusedLion(Lion):
    """Lion (chunked on CPU, foreach elsewhere); ``set_grad_none`` as in DeepSpeed."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), weight_decay=0., set_grad_none=True):
        super().__init__(params, lr=lr, betas=betas, weight_decay=weight_decay)
        self.set_grad_none = set_grad_none

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        super().zero_grad(set_to_none=self.set_grad_none if set_to_none is None else set_to_none)
