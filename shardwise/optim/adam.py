"""Adam/AdamW and Adagrad with DeepSpeed's options, on torch's fused kernels where they apply.

These are the engines behind ``shardwise.ops.adam.DeepSpeedCPUAdam`` /
``FusedAdam`` and ``shardwise.ops.adagrad.DeepSpeedCPUAdagrad``; the config's
``Adam``/``AdamW``/``Adagrad`` use ``torch.optim`` classes with ``fused=True``,
so both reach the same kernel.

Per tensor, the update takes torch's fused kernel (one pass over memory; CPU
and CUDA) when torch's kernel computes exactly what was asked: states in the
parameter's dtype and, for Adam, bias correction on.  Otherwise (DeepSpeed's
``fp32_optimizer_states`` with 16-bit parameters, ``bias_correction=False``)
the chunked implementation of ``shardwise.optim.chunked`` runs the ops of
torch's reference (single-tensor) step in the state dtype, chunk by chunk.

State keys are torch's (``step`` as a 0-d float32 tensor, ``exp_avg``,
``exp_avg_sq``) so checkpoints and ZeRO treat them like ``torch.optim.Adam``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.optim.adagrad import adagrad as torch_adagrad
from torch.optim.adam import adam as torch_adam

from . import chunked

_FUSED_DEVICES = ("cpu", "cuda")
_FUSED_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


def _fusable(p: torch.Tensor, state_dtype: torch.dtype) -> bool:
    return p.device.type in _FUSED_DEVICES and p.dtype in _FUSED_DTYPES and state_dtype == p.dtype


def _contiguous_step(fn: Callable[..., None], *tensors: torch.Tensor, **kwargs: Any) -> None:
    """Run a chunked update on contiguous tensors, copying back into any that were not."""
    work = [t if t.is_contiguous() else t.contiguous() for t in tensors]
    fn(*work, **kwargs)
    for t, w in zip(tensors, work):
        if w is not t:
            t.copy_(w)


class _DeviceCheck:
    """DeepSpeed's CPU optimizers refuse parameters that are not on the CPU, and keep their states in
    fp32 across ``load_state_dict`` when ``fp32_optimizer_states`` is on (torch would cast them to the
    parameter dtype)."""

    _cpu_only = False
    _label = "optimizer"
    fp32_optimizer_states = False

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        if not self.fp32_optimizer_states:
            return
        ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for i, p in zip(ids, params):
            for key, value in state_dict["state"].get(i, {}).items():
                if key != "step" and torch.is_tensor(value) and value.is_floating_point():
                    self.state[p][key] = value.to(device=p.device, dtype=torch.float32, copy=True)

    def _check_device(self, p: torch.Tensor) -> None:
        if self._cpu_only and p.device.type != "cpu":
            raise ValueError(
                f"{self._label}: a parameter is on {p.device}; this optimizer steps CPU tensors only. "
                "Enable zero_optimization.offload_optimizer.device 'cpu', or use FusedAdam/the config optimizer"
            )


class Adam(_DeviceCheck, torch.optim.Optimizer):
    """Adam (``adamw_mode=False``: L2 decay added to the gradient) or AdamW (decoupled decay)."""

    def __init__(self, params, lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 amsgrad: bool = False, *, adamw_mode: bool = True, fp32_optimizer_states: bool = False,
                 set_grad_none: bool = True) -> None:
        if not lr >= 0.0:
            raise ValueError(f"lr must be >= 0, got {lr}")
        if not eps >= 0.0:
            raise ValueError(f"eps must be >= 0, got {eps}")
        if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"betas must be two numbers in [0, 1), got {betas}")
        if not weight_decay >= 0.0:
            raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
        self.adam_w_mode = adamw_mode
        self.fp32_optimizer_states = fp32_optimizer_states
        self.set_grad_none = set_grad_none
        self._scratch = chunked.Scratch()
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        bias_correction=bias_correction, amsgrad=amsgrad)
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if param_group.get("amsgrad", self.defaults["amsgrad"]):
            raise RuntimeError(f"{type(self).__name__} does not support the AMSGrad variant.")
        super().add_param_group(param_group)

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        super().zero_grad(set_to_none=self.set_grad_none if set_to_none is None else set_to_none)

    def _state_dtype(self, p: torch.Tensor) -> torch.dtype:
        return torch.float32 if self.fp32_optimizer_states else p.dtype

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, eps, wd = float(group["lr"]), group["eps"], group["weight_decay"]
            fused: dict[str, list[torch.Tensor]] = {"p": [], "g": [], "m": [], "v": [], "t": []}
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
                self._check_device(p)
                state = self.state[p]
                if not state:
                    dtype = self._state_dtype(p)
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
                if group["bias_correction"] and _fusable(p, state["exp_avg"].dtype):
                    for key, t in zip("pgmvt", (p, p.grad, state["exp_avg"], state["exp_avg_sq"], state["step"])):
                        fused[key].append(t)
                    continue
                state["step"] += 1
                _contiguous_step(chunked.adam_, p, p.grad, state["exp_avg"], state["exp_avg_sq"],
                                 step=state["step"].item(), lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                                 weight_decay=wd, decoupled=self.adam_w_mode,
                                 bias_correction=group["bias_correction"], scratch=self._scratch)
            if fused["p"]:
                torch_adam(fused["p"], fused["g"], fused["m"], fused["v"], [], fused["t"], fused=True,
                           decoupled_weight_decay=self.adam_w_mode, amsgrad=False, beta1=beta1, beta2=beta2,
                           lr=lr, weight_decay=wd, eps=eps, maximize=False)
        return loss


class Adagrad(_DeviceCheck, torch.optim.Optimizer):
    """Adagrad as DeepSpeed's CPU Adagrad computes it (torch's Adagrad with ``lr_decay`` 0).

    The accumulated squares are kept under DeepSpeed's key ``exp_avg_sq``.
    """

    def __init__(self, params, lr: float = 1e-2, eps: float = 1e-10, weight_decay: float = 0.0,
                 amsgrad: bool = False, *, fp32_optimizer_states: bool = False) -> None:
        if not lr >= 0.0:
            raise ValueError(f"lr must be >= 0, got {lr}")
        if not eps >= 0.0:
            raise ValueError(f"eps must be >= 0, got {eps}")
        if not weight_decay >= 0.0:
            raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
        self.fp32_optimizer_states = fp32_optimizer_states
        self._scratch = chunked.Scratch()
        super().__init__(params, dict(lr=lr, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad))

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, eps, wd = float(group["lr"]), group["eps"], group["weight_decay"]
            fused: dict[str, list[torch.Tensor]] = {"p": [], "g": [], "s": [], "t": []}
            for p in group["params"]:
                if p.grad is None:
                    continue
                self._check_device(p)
                state = self.state[p]
                if not state:
                    dtype = torch.float32 if self.fp32_optimizer_states else p.dtype
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
                if p.grad.is_sparse:  # torch's single-tensor path handles sparse gradients
                    torch_adagrad([p], [p.grad], [state["exp_avg_sq"]], [state["step"]], has_sparse_grad=True,
                                  foreach=False, lr=lr, weight_decay=wd, lr_decay=0.0, eps=eps, maximize=False)
                elif _fusable(p, state["exp_avg_sq"].dtype):
                    for key, t in zip("pgst", (p, p.grad, state["exp_avg_sq"], state["step"])):
                        fused[key].append(t)
                else:
                    state["step"] += 1
                    _contiguous_step(chunked.adagrad_, p, p.grad, state["exp_avg_sq"], step=state["step"].item(),
                                     lr=lr, lr_decay=0.0, eps=eps, weight_decay=wd, scratch=self._scratch)
            if fused["p"]:
                torch_adagrad(fused["p"], fused["g"], fused["s"], fused["t"], fused=True, lr=lr, weight_decay=wd,
                              lr_decay=0.0, eps=eps, maximize=False)
        return loss
