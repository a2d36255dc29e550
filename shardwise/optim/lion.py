"""Lion optimizer (Chen et al., 2023, "Symbolic Discovery of Optimization Algorithms").

For every parameter ``p`` with gradient ``g`` and momentum ``m``::

    c = beta1 * m + (1 - beta1) * g
    p = p * (1 - lr * weight_decay) - lr * sign(c)
    m = beta2 * m + (1 - beta2) * g

Defaults follow DeepSpeed's ``FusedLion`` (lr 1e-3, betas (0.9, 0.999),
weight_decay 0). Two implementations give the same result to rounding:

- chunked (the default for CPU tensors): each parameter is walked in cache-sized
  chunks (``shardwise.optim.chunked``), with no temporary the size of the
  parameters and one pass over memory;
- ``foreach`` (the default elsewhere, and the reference the tests compare
  against): ``torch._foreach_*`` ops, a handful of kernel launches per group.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from . import chunked


class Lion(torch.optim.Optimizer):
    """Sign-momentum optimizer with decoupled weight decay."""

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        weight_decay: float = 0.0,
        *,
        foreach: bool | None = None,
    ) -> None:
        if not lr >= 0.0:
            raise ValueError(f"lr must be >= 0, got {lr}")
        if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"betas must be two numbers in [0, 1), got {betas}")
        if not weight_decay >= 0.0:
            raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
        defaults = dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay)
        super().__init__(params, defaults)
        self.foreach = foreach  # None: chunked for CPU tensors, foreach elsewhere; True: foreach everywhere
        self._scratch = chunked.Scratch()

    def _state_dtype(self, p: torch.Tensor) -> torch.dtype:
        return p.dtype

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()

        for group in self.param_groups:
            params: list[torch.Tensor] = []
            grads: list[torch.Tensor] = []
            moms: list[torch.Tensor] = []
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("Lion does not support sparse gradients")
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p, dtype=self._state_dtype(p),
                                                        memory_format=torch.preserve_format)
                if (not self.foreach and p.device.type == "cpu" or state["exp_avg"].dtype != p.dtype) \
                        and chunked.can_chunk(p, p.grad, state["exp_avg"]):
                    beta1, beta2 = group["betas"]
                    chunked.lion_(p, p.grad, state["exp_avg"], lr=float(group["lr"]), beta1=beta1, beta2=beta2,
                                  weight_decay=group["weight_decay"], scratch=self._scratch)
                    continue
                params.append(p)
                grads.append(p.grad)
                moms.append(state["exp_avg"])
            if not params:
                continue

            lr = float(group["lr"])
            beta1, beta2 = group["betas"]
            wd = group["weight_decay"]

            # c = beta1 * m + (1 - beta1) * g  (a fresh list; m is still needed below)
            interp = torch._foreach_mul(moms, beta1)
            torch._foreach_add_(interp, grads, alpha=1.0 - beta1)
            torch._foreach_sign_(interp)
            if wd != 0.0:
                torch._foreach_mul_(params, 1.0 - lr * wd)
            torch._foreach_add_(params, interp, alpha=-lr)
            # m = beta2 * m + (1 - beta2) * g
            torch._foreach_mul_(moms, beta2)
            torch._foreach_add_(moms, grads, alpha=1.0 - beta2)
        return loss
