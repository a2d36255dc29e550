"""Setting whole parameters and optimizer states under any ZeRO stage
(DeepSpeed's ``safe_set_full_fp32_param`` / ``safe_set_full_optimizer_state``).

The value is the whole tensor, given on every rank; each rank writes the part it owns.
"""

from __future__ import annotations

import torch

from shardwise.utils.tensor_fragment import _owner
from shardwise.zero.partitioned_param import full_shape, is_partitioned, scatter_full_

__all__ = ["safe_set_full_fp32_param", "safe_set_full_optimizer_state"]


def safe_set_full_fp32_param(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    """Set the fp32 (master) weights of ``param`` to ``value`` (the whole tensor, on every rank);
    the model's (possibly 16-bit, possibly sharded) weights follow. Call it on every rank."""
    engine, name = _owner(param)
    full = _whole(param, value)
    if param.requires_grad:
        _write_fragments(engine, name, full, state_key=None)
    with torch.no_grad():
        if is_partitioned(param):
            scatter_full_(param, full.to(param.ds_tensor.dtype))
        else:
            param.data.copy_(full.view(param.shape).to(param.dtype))


def safe_set_full_optimizer_state(param: torch.nn.Parameter, value: torch.Tensor, optim_state_key: str) -> None:
    """Set one per-element optimizer state of ``param`` (e.g. ``"exp_avg"``) to ``value`` (whole)."""
    engine, name = _owner(param)
    _write_fragments(engine, name, _whole(param, value), state_key=optim_state_key)


def _whole(param: torch.nn.Parameter, value: torch.Tensor) -> torch.Tensor:
    shape = full_shape(param)
    if tuple(value.shape) != tuple(shape):
        raise ValueError(f"value has shape {tuple(value.shape)}, the parameter has shape {tuple(shape)}")
    return value.detach().reshape(-1).float()


def _write_fragments(engine, name: str, full: torch.Tensor, *, state_key: str | None) -> None:
    if engine.zero_offload_optimizer() is not None and engine.zero_offload_optimizer().device == "nvme":
        raise NotImplementedError("safe_set_full_*: not supported with the optimizer offloaded to NVMe "
                                  "(zero_optimization.offload_optimizer.device is 'nvme')")
    with torch.no_grad():
        for fname, start, end, t in (x for batch in engine.strategy.fragment_batches() for x in batch):
            if fname != name:
                continue
            if state_key is None:
                t.view(-1).copy_(full[start:end].to(t.device))
                continue
            state = engine.optimizer.state.get(t, {}) if engine.optimizer is not None else {}
            if state_key not in state:
                raise KeyError(f"no optimizer state '{state_key}' for {name} (has the optimizer stepped yet?)")
            state[state_key].view(-1).copy_(full[start:end].to(state[state_key].device))
