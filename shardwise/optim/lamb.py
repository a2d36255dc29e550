"""LAMB optimizer with the semantics of DeepSpeed's ``FusedLamb``.

For each parameter tensor ``p`` (gradient ``g``, step ``t``)::

    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    u = m / (sqrt(v) + eps) + weight_decay * p        # eps_inside_sqrt: m / sqrt(v + eps)
    trust = clamp(||p|| / ||u||, min_coeff, max_coeff)  (1 when either norm is 0)
    step_size = lr * sqrt(1 - beta2**t) / (1 - beta1**t)  (lr without bias_correction)
    p = p - step_size * trust * u

As in DeepSpeed, bias correction is folded into ``step_size`` and the trust
ratio is measured on the uncorrected update. ``get_lamb_coeffs()`` returns the
trust ratios of the last step, one per updated tensor.

CPU tensors are updated chunk by chunk (``shardwise.optim.chunked``: two
passes, no temporary the size of the parameters); elsewhere, or with
``foreach=True`` (the reference the tests compare against), with
``torch._foreach_*`` ops.  The two agree to rounding: the chunked norms are
sums of per-chunk partial sums.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch

from . import chunked


class Lamb(torch.optim.Optimizer):
    """Layer-wise adaptive large-batch optimizer (You et al., 2019)."""

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        eps_inside_sqrt: bool = False,
        weight_decay: float = 0.0,
        max_coeff: float = 10.0,
        min_coeff: float = 0.01,
        amsgrad: bool = False,
        *,
        foreach: bool | None = None,
    ) -> None:
        if amsgrad:
            raise ValueError("amsgrad: Lamb has no AMSGrad variant; remove the parameter or set it to false")
        if not lr >= 0.0:
            raise ValueError(f"lr must be >= 0, got {lr}")
        if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"betas must be two numbers in [0, 1), got {betas}")
        if not eps >= 0.0:
            raise ValueError(f"eps must be >= 0, got {eps}")
        if not weight_decay >= 0.0:
            raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
        if not 0.0 < min_coeff <= max_coeff:
            raise ValueError(f"need 0 < min_coeff <= max_coeff, got min_coeff={min_coeff}, max_coeff={max_coeff}")
        defaults = dict(
            lr=lr,
            bias_correction=bias_correction,
            betas=tuple(betas),
            eps=eps,
            eps_inside_sqrt=eps_inside_sqrt,
            weight_decay=weight_decay,
            max_coeff=max_coeff,
            min_coeff=min_coeff,
        )
        super().__init__(params, defaults)
        self.foreach = foreach  # None: chunked for CPU tensors, foreach elsewhere; True: foreach everywhere
        self._scratch = chunked.Scratch()
        self._last_coeffs: list[torch.Tensor] = []

    def _grad_divisor(self, group: dict[str, Any], p: torch.Tensor) -> float:
        return 1.0

    def get_lamb_coeffs(self) -> list[float]:
        """Trust ratios applied in the last ``step()``, in parameter order."""
        return [float(c) for chunk in self._last_coeffs for c in chunk.tolist()]

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()

        self._last_coeffs = []
        for group in self.param_groups:
            # Tensors of one device and dtype are updated together with foreach ops.
            buckets: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("Lamb does not support sparse gradients")
                state = self.state[p]
                if not state:
                    # A CPU step counter, like torch's non-capturable Adam, so reading it never syncs.
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                if not self.foreach and p.device.type == "cpu" and chunked.can_chunk(
                        p, p.grad, state["exp_avg"], state["exp_avg_sq"]):
                    self._update_chunked(group, p)
                    continue
                buckets.setdefault((p.device, p.dtype), []).append(p)
            for (device, _), params in buckets.items():
                self._update(group, params, device)
        return loss

    def _update_chunked(self, group: dict[str, Any], p: torch.Tensor) -> None:
        state = self.state[p]
        beta1, beta2 = group["betas"]
        lr = float(group["lr"])
        state["step"] += 1
        t = state["step"].item()
        step_size = lr * math.sqrt(1.0 - beta2**t) / (1.0 - beta1**t) if group["bias_correction"] else lr
        coeff = chunked.lamb_(p, p.grad, state["exp_avg"], state["exp_avg_sq"], step_size=step_size, beta1=beta1,
                              beta2=beta2, eps=group["eps"], eps_inside_sqrt=group["eps_inside_sqrt"],
                              weight_decay=group["weight_decay"], max_coeff=group["max_coeff"],
                              min_coeff=group["min_coeff"], grad_divisor=self._grad_divisor(group, p),
                              scratch=self._scratch)
        self._last_coeffs.append(coeff.reshape(1))

    def _update(self, group: dict[str, Any], params: list[torch.Tensor], device: torch.device) -> None:
        beta1, beta2 = group["betas"]
        lr = float(group["lr"])
        eps, wd = group["eps"], group["weight_decay"]
        grads = [p.grad for p in params]
        divisors = [self._grad_divisor(group, p) for p in params]
        if any(d != 1.0 for d in divisors):
            grads = torch._foreach_div(grads, divisors)
        exp_avgs = [self.state[p]["exp_avg"] for p in params]
        exp_avg_sqs = [self.state[p]["exp_avg_sq"] for p in params]

        step_sizes = []
        for p in params:
            step_t = self.state[p]["step"]
            step_t += 1
            t = step_t.item()
            if group["bias_correction"]:
                step_sizes.append(lr * math.sqrt(1.0 - beta2**t) / (1.0 - beta1**t))
            else:
                step_sizes.append(lr)

        torch._foreach_mul_(exp_avgs, beta1)
        torch._foreach_add_(exp_avgs, grads, alpha=1.0 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1.0 - beta2)

        if group["eps_inside_sqrt"]:
            denom = torch._foreach_add(exp_avg_sqs, eps)
            torch._foreach_sqrt_(denom)
        else:
            denom = torch._foreach_sqrt(exp_avg_sqs)
            torch._foreach_add_(denom, eps)
        updates = torch._foreach_div(exp_avgs, denom)
        del denom
        if wd != 0.0:
            torch._foreach_add_(updates, params, alpha=wd)

        # Norms in fp32 so a 16-bit tensor's norm cannot overflow.
        norm_dtype = torch.promote_types(params[0].dtype, torch.float32)
        w_norm = torch.stack(torch._foreach_norm(params, 2, dtype=norm_dtype))
        u_norm = torch.stack(torch._foreach_norm(updates, 2, dtype=norm_dtype))
        ratio = (w_norm / u_norm).clamp(group["min_coeff"], group["max_coeff"])
        coeffs = torch.where((w_norm > 0) & (u_norm > 0), ratio, torch.ones_like(ratio))
        self._last_coeffs.append(coeffs)

        factors = coeffs * torch.tensor(step_sizes, dtype=torch.float32, device=device).neg()
        torch._foreach_mul_(updates, list(factors.to(params[0].dtype).unbind()))
        torch._foreach_add_(params, updates)
