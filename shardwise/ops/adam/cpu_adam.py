"""``deepspeed.ops.adam.cpu_adam.DeepSpeedCPUAdam`` on torch's fused CPU Adam kernel."""

from __future__ import annotations

import torch

from shardwise.optim import chunked
from shardwise.optim.adam import Adam, _contiguous_step


class DeepSpeedCPUAdam(Adam):
    """Adam/AdamW for parameters on the CPU (ZeRO-Offload), with DeepSpeed's arguments.

    ``adamw_mode`` (default true) selects decoupled weight decay; false adds
    ``weight_decay * p`` to the gradient.  ``fp32_optimizer_states`` (default true)
    keeps the moments in fp32 whatever the parameter dtype.  ``amsgrad=True`` is
    refused, as in DeepSpeed.
    """

    optimizer_id = 0
    _cpu_only = True
    _label = "DeepSpeedCPUAdam"

    def __init__(self, model_params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8,
                 weight_decay=0, amsgrad=False, adamw_mode=True, fp32_optimizer_states=True):
        super().__init__(model_params, lr=lr, bias_correction=bias_correction, betas=betas, eps=eps,
                         weight_decay=weight_decay, amsgrad=amsgrad, adamw_mode=adamw_mode,
                         fp32_optimizer_states=fp32_optimizer_states, set_grad_none=True)
        self.opt_id = DeepSpeedCPUAdam.optimizer_id
        DeepSpeedCPUAdam.optimizer_id += 1

    # -- DeepSpeed's sub-group interface (ZeRO-Offload's bookkeeping per flat sub-group) ----------
    # ``self.state[subgroup_id]`` holds one set of moments per sub-group, as in DeepSpeed, where each
    # sub-group is one flat fp32 partition; the parameters stepped are those of ``param_groups`` that
    # have a gradient.
    @torch.no_grad()
    def step_subgroup(self, subgroup_id: int, closure=None):
        """One Adam step of the parameters with a gradient, with the moments of ``subgroup_id``."""
        loss = _run_closure(closure)
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                self._check_device(p)
                state = self.state[subgroup_id]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, dtype=self._state_dtype(p))
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=self._state_dtype(p))
                state["step"] += 1
                _contiguous_step(chunked.adam_, p, p.grad, state["exp_avg"], state["exp_avg_sq"],
                                 step=float(state["step"]), lr=float(group["lr"]), beta1=beta1, beta2=beta2,
                                 eps=group["eps"], weight_decay=group["weight_decay"], decoupled=self.adam_w_mode,
                                 bias_correction=group["bias_correction"], scratch=self._scratch)
        return loss

    @torch.no_grad()
    def rollback_subgroup(self, sub_group_id: int, closure=None):
        """Undo the last ``step_subgroup(sub_group_id)``: parameters and moments go back to what they
        were before it (up to rounding), given the same gradients; the step count drops by one."""
        loss = _run_closure(closure)
        state = self.state[sub_group_id] if sub_group_id in self.state else None
        if not state:
            raise RuntimeError(f"Cannot rollback optimizer state for sub_group_id {sub_group_id} "
                               "as it has not been initialized.")
        if state.get("step", 0) <= 0:
            raise RuntimeError(f"Cannot rollback sub_group_id {sub_group_id}: step count is {state.get('step', 0)}")
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                self._check_device(p)
                _adam_rollback_(p, p.grad, state["exp_avg"], state["exp_avg_sq"], step=state["step"], group=group,
                                decoupled=self.adam_w_mode)
                state["step"] -= 1
        return loss


def _run_closure(closure):
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


def _adam_rollback_(p, g, exp_avg, exp_avg_sq, *, step: int, group: dict, decoupled: bool) -> None:
    """Invert one Adam/AdamW step in fp32: the parameter from the moments after the step, then the
    moments (with L2 decay, the gradient the moments saw included ``weight_decay * p`` before the step)."""
    beta1, beta2 = group["betas"]
    lr, eps, wd = float(group["lr"]), group["eps"], group["weight_decay"]
    bc1 = 1.0 - beta1**step if group["bias_correction"] else 1.0
    bc2 = 1.0 - beta2**step if group["bias_correction"] else 1.0
    m, v = exp_avg.float(), exp_avg_sq.float()
    update = (m / bc1) / ((v / bc2).sqrt() + eps)
    prev = p.float() + lr * update
    grad = g.float()
    if wd != 0.0:
        if decoupled:
            prev.div_(1.0 - lr * wd)
        else:
            grad = grad + wd * prev
    exp_avg.copy_((m - (1.0 - beta1) * grad) / beta1)
    exp_avg_sq.copy_(((v - (1.0 - beta2) * grad * grad) / beta2).clamp_(min=0.0))
    p.copy_(prev)
