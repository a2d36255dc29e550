"""``deepspeed.ops.lamb.fused_lamb.FusedLamb`` on the chunked Lamb update (foreach off the CPU)."""

from __future__ import annotations

from typing import Any

import torch

from shardwise.optim.lamb import Lamb


class FusedLamb(Lamb):
    """Lamb with DeepSpeed's ``FusedLamb`` arguments and ``step()`` signature.

    ``step(scale=s)`` divides the gradients by ``s`` first; with ``max_grad_norm`` > 0
    and ``grad_norms`` given (one norm per param group, or per parameter), the
    divisor grows to ``(norm / s + 1e-6) / max_grad_norm`` when that is above 1, as in
    DeepSpeed.  ``get_lamb_coeffs()`` returns the trust ratios of the last step.
    ``amsgrad=True`` is refused.
    """

    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8, eps_inside_sqrt=False,
                 weight_decay=0., max_grad_norm=0., max_coeff=10.0, min_coeff=0.01, amsgrad=False):
        if amsgrad:
            raise RuntimeError("FusedLamb does not support the AMSGrad variant.")
        if not max_grad_norm >= 0.0:
            raise ValueError(f"max_grad_norm must be >= 0, got {max_grad_norm}")
        super().__init__(params, lr=lr, bias_correction=bias_correction, betas=betas, eps=eps,
                         eps_inside_sqrt=eps_inside_sqrt, weight_decay=weight_decay, max_coeff=max_coeff,
                         min_coeff=min_coeff)
        for group in self.param_groups:
            group.setdefault("max_grad_norm", max_grad_norm)
        self.defaults["max_grad_norm"] = max_grad_norm
        self._divisors: dict[int, float] = {}

    def _grad_divisor(self, group: dict[str, Any], p: torch.Tensor) -> float:
        return self._divisors.get(id(p), 1.0)

    @torch.no_grad()
    def step(self, closure=None, grads=None, output_params=None, scale=1., grad_norms=None):
        if grads is not None or output_params is not None:
            raise ValueError("FusedLamb.step: 'grads' and 'output_params' are not supported; the gradients are "
                             "read from each parameter's .grad")
        if grad_norms is None:
            grad_norms = [None] * len(self.param_groups)
        self._divisors = {}
        for group, norms in zip(self.param_groups, grad_norms):
            norms = norms if isinstance(norms, (list, tuple)) else [norms] * len(group["params"])
            for p, norm in zip(group["params"], norms):
                divisor = float(scale)
                if group.get("max_grad_norm", 0.0) > 0:
                    if norm is None:
                        raise ValueError("FusedLamb.step: max_grad_norm > 0 needs grad_norms=")
                    clip = ((float(norm) / scale) + 1e-6) / group["max_grad_norm"]
                    if clip > 1:
                        divisor = clip * scale
                self._divisors[id(p)] = divisor
        try:
            return super().step(closure)
        finally:
            self._divisors = {}
