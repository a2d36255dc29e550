"""Setting whole parameters, gradients and optimizer states under any ZeRO stage
(DeepSpeed's ``safe_set_full_fp32_param`` / ``safe_set_full_grad`` / ``safe_set_full_optimizer_state``).

The value is the whole tensor, given on every rank; each rank writes the part it owns.
"""

from __future__ import annotations

import torch

from shardwise.zero import registry
from shardwise.zero.partitioned_param import full_shape, is_partitioned, scatter_full_

__all__ = ["safe_set_full_fp32_param", "safe_set_full_grad", "safe_set_full_optimizer_state",
           "safe_update_full_grad_vectorized"]


def safe_set_full_fp32_param(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    """Set the fp32 (master) weights of ``param`` to ``value`` (the whole tensor, on every rank);
    the model's (possibly 16-bit, possibly sharded) weights follow. Call it on every rank."""
    strategy, name = _owner(param)
    full = _whole(param, value)
    if param.requires_grad:
        _write_fragments(strategy, name, full, state_key=None)
    with torch.no_grad():
        if is_partitioned(param):
            scatter_full_(param, full.to(param.ds_tensor.dtype))
        else:
            param.data.copy_(full.view(param.shape).to(param.dtype))


def safe_set_full_optimizer_state(param: torch.nn.Parameter, value: torch.Tensor, optim_state_key: str) -> None:
    """Set one per-element optimizer state of ``param`` (e.g. ``"exp_avg"``) to ``value`` (whole)."""
    strategy, name = _owner(param)
    _write_fragments(strategy, name, _whole(param, value), state_key=optim_state_key)


def safe_set_full_grad(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    """Replace the reduced gradient of ``param`` by ``value`` (the whole, unscaled gradient, on every
    rank), after ``engine.backward`` at an accumulation boundary and before ``engine.step``: the step
    (its norm, clipping and overflow check included) then uses it. Call it on every rank."""
    strategy, name = _owner(param)
    if not param.requires_grad:
        raise ValueError(f"safe_set_full_grad: parameter {name} is frozen (requires_grad=False): it has no gradient")
    partition = getattr(strategy, "partition", None)
    if partition is not None and partition.step_in_flight:
        raise RuntimeError("safe_set_full_grad: with offload_optimizer the optimizer step of each sub-group runs "
                           "during the boundary backward (no clipping, no overflow check), before the gradient "
                           "can be replaced; set engine.strategy.partition.overlap_step = False to step after it")
    full = _whole(param, value) * registry.loss_scale_of(strategy)  # stored as backward left them: scaled
    with torch.no_grad():
        for fname, start, end, _ in (x for batch in strategy.fragment_batches() for x in batch):
            if fname == name:
                grad = strategy.local_grad(name, start, end)
                grad.view(-1).copy_(full[start:end].to(grad.device))


def safe_update_full_grad_vectorized(params, update_func) -> None:
    """For each trainable parameter ``p`` of ``params``: set its whole gradient to
    ``update_func(<its whole gradient>, p)`` (``safe_get_full_grad`` then ``safe_set_full_grad``).
    Call it on every rank with the same list."""
    from shardwise.utils.tensor_fragment import safe_get_full_grad

    for p in params:
        if p.requires_grad:
            safe_set_full_grad(p, update_func(safe_get_full_grad(p), p))


def _owner(param: torch.nn.Parameter):
    owner = registry.owner_of(param)
    if owner is None:
        raise ValueError("this parameter does not belong to a model wrapped by shardwise.initialize()")
    return owner


def _whole(param: torch.nn.Parameter, value: torch.Tensor) -> torch.Tensor:
    shape = full_shape(param)
    if tuple(value.shape) != tuple(shape):
        raise ValueError(f"value has shape {tuple(value.shape)}, the parameter has shape {tuple(shape)}")
    return value.detach().reshape(-1).float()


def _write_fragments(strategy, name: str, full: torch.Tensor, *, state_key: str | None) -> None:
    if getattr(strategy, "swapper", None) is not None:  # the optimizer's tensors live in files
        raise NotImplementedError("safe_set_full_*: not supported with the optimizer offloaded to NVMe "
                                  "(zero_optimization.offload_optimizer.device is 'nvme')")
    with torch.no_grad():
        for fname, start, end, t in (x for batch in strategy.fragment_batches() for x in batch):
            if fname != name:
                continue
            if state_key is None:
                t.view(-1).copy_(full[start:end].to(t.device))
                continue
            state = strategy.optimizer.state.get(t, {}) if strategy.optimizer is not None else {}
            if state_key not in state:
                raise KeyError(f"no optimizer state '{state_key}' for {name} (has the optimizer stepped yet?)")
            state[state_key].view(-1).copy_(full[start:end].to(state[state_key].device))
