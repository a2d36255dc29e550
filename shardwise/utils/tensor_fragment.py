"""Stage-independent access to whole parameters, gradients and optimizer states.

Under ZeRO a rank holds only its share of the fp32 weights, gradients and
optimizer state; these functions assemble the whole tensor of one model
parameter from every rank (DeepSpeed's ``deepspeed.utils.safe_get_full_*``).
With a partitioned stage they are collective: call them on every rank.
"""

from __future__ import annotations

import torch

from shardwise.zero import registry
from shardwise.zero.partitioned_param import full_shape, is_partitioned

__all__ = ["safe_get_full_fp32_param", "safe_get_full_grad", "safe_get_full_optimizer_state"]


def _owner(param: torch.nn.Parameter):
    owner = registry.owner_of(param)
    if owner is None:
        raise ValueError("this parameter does not belong to a model wrapped by shardwise.initialize()")
    return owner


def safe_get_full_fp32_param(param: torch.nn.Parameter) -> torch.Tensor:
    """The fp32 (master) weights of ``param``, whole."""
    strategy, name = _owner(param)
    if not param.requires_grad:  # frozen: no master copy, the (possibly partitioned) weight itself
        from shardwise.zero.partitioned_param import gather_full

        return (gather_full(param) if is_partitioned(param) else param.detach()).float()
    return strategy.gather_full(name, full_shape(param), "param")


def safe_get_full_grad(param: torch.nn.Parameter) -> torch.Tensor:
    """The reduced gradient of ``param`` (after ``engine.backward`` at an accumulation boundary,
    before ``engine.step``), unscaled, in fp32."""
    strategy, name = _owner(param)
    grad = strategy.gather_full(name, full_shape(param), "grad")
    scale = registry.loss_scale_of(strategy)
    return grad / scale if scale != 1.0 else grad


def safe_get_full_optimizer_state(param: torch.nn.Parameter, optim_state_key: str) -> torch.Tensor:
    """One per-element optimizer state of ``param`` (e.g. ``"exp_avg"``), whole, in fp32."""
    strategy, name = _owner(param)
    return strategy.gather_full(name, full_shape(param), optim_state_key)
