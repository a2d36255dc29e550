"""This rank's part of a ZeRO-3 parameter's fp32 weights, gradient and optimizer state
(DeepSpeed's ``safe_get_local_*`` / ``safe_set_local_*``).

Under ZeRO-3 rank r holds chunk r of every parameter: elements ``[r*c, (r+1)*c)`` of the flattened
parameter, ``c = ceil(numel / world)``, the last chunk zero-padded (``param.ds_tensor`` has ``c``
elements). A local value is that chunk, 1-D, ``c`` elements: no collective, each rank reads or writes
its own. Elements past the end of the parameter read as zero and are not written.
"""

from __future__ import annotations

import contextlib

import torch

from shardwise.zero import registry
from shardwise.zero.partitioned_param import chunk_size, is_partitioned, owned_range, unit_of

__all__ = ["safe_get_local_fp32_param", "safe_get_local_grad", "safe_get_local_optimizer_state",
           "safe_set_local_fp32_param", "safe_set_local_grad", "safe_set_local_optimizer_state"]


def safe_get_local_fp32_param(param: torch.nn.Parameter) -> torch.Tensor | None:
    """This rank's chunk of the fp32 (master) weights; None for a frozen parameter."""
    return _read(param, "param")


def safe_get_local_grad(param: torch.nn.Parameter) -> torch.Tensor | None:
    """This rank's chunk of the reduced gradient (after ``engine.backward``, unscaled, fp32); None if frozen."""
    return _read(param, "grad")


def safe_get_local_optimizer_state(param: torch.nn.Parameter, optim_state_key: str) -> torch.Tensor | None:
    """This rank's chunk of one per-element optimizer state (e.g. ``"exp_avg"``); None if frozen."""
    return _read(param, optim_state_key)


def safe_set_local_fp32_param(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    """Set this rank's chunk of the fp32 (master) weights; this rank's shard of the model weights follows."""
    _write(param, value, "param")


def safe_set_local_grad(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    """Set this rank's chunk of the reduced gradient (unscaled), before ``engine.step``."""
    _write(param, value, "grad")


def safe_set_local_optimizer_state(param: torch.nn.Parameter, value: torch.Tensor, optim_state_key: str) -> None:
    """Set this rank's chunk of one per-element optimizer state (e.g. ``"exp_avg"``)."""
    _write(param, value, optim_state_key)


def _owned(param: torch.nn.Parameter):
    """(strategy, name, start, end, optimizer tensor or None) of ``param``'s chunk on this rank."""
    owner = registry.owner_of(param)
    if owner is None:
        raise ValueError("this parameter does not belong to a model wrapped by shardwise.initialize()")
    strategy, name = owner
    if not is_partitioned(param) or not strategy.shards_parameters:
        raise ValueError(f"safe_*_local_* is defined for ZeRO-3 partitioned parameters only ({name} is not one); "
                         "use safe_get_full_* / safe_set_full_*")
    start, end = owned_range(param)
    for fname, fstart, fend, t in (x for batch in strategy.fragment_batches() for x in batch):
        if fname == name:
            assert (fstart, fend) == (start, end), (name, fstart, fend, start, end)
            return strategy, name, start, end, t
    return strategy, name, start, end, None  # this rank's chunk is only padding


def _state(strategy, name: str, t: torch.Tensor, key: str) -> torch.Tensor:
    state = strategy.optimizer.state.get(t, {}) if strategy.optimizer is not None else {}
    if key not in state:
        raise KeyError(f"no optimizer state '{key}' for {name} (has the optimizer stepped yet?)")
    return state[key]


def _read(param: torch.nn.Parameter, what: str) -> torch.Tensor | None:
    if not param.requires_grad:
        return None
    strategy, name, start, end, t = _owned(param)
    out = torch.zeros(chunk_size(param), dtype=torch.float32, device=t.device if t is not None else "cpu")
    if t is None:
        return out
    if what == "param":
        src = t
    elif what == "grad":
        src = strategy.local_grad(name, start, end).float() / registry.loss_scale_of(strategy)
    else:
        src = _state(strategy, name, t, what)
    out[: end - start] = src.detach().reshape(-1).to(out.device, torch.float32)
    return out


def _write(param: torch.nn.Parameter, value: torch.Tensor, what: str) -> None:
    if not param.requires_grad:
        raise ValueError("safe_set_local_*: the parameter is frozen (requires_grad=False): ZeRO keeps no fp32 "
                         "copy, gradient or optimizer state of it")
    strategy, name, start, end, t = _owned(param)
    chunk = chunk_size(param)
    if value.numel() != chunk:
        raise ValueError(f"safe_set_local_*: value has {value.numel()} elements, this rank's chunk of {name} has {chunk}")
    flat = value.detach().reshape(-1)[: end - start]
    if t is None:
        return
    with torch.no_grad():
        if what == "param":
            t.view(-1).copy_(flat.to(t.device, t.dtype))
            unit = unit_of(param)  # the model's shard follows (it may live in a file: offload_param nvme)
            with unit.resident(write=True) if unit is not None else contextlib.nullcontext():
                param.ds_tensor[: end - start].copy_(flat.to(param.ds_tensor.dtype))
        elif what == "grad":
            grad = strategy.local_grad(name, start, end)
            grad.view(-1).copy_(flat.float().mul(registry.loss_scale_of(strategy)).to(grad.device, grad.dtype))
        else:
            state = _state(strategy, name, t, what)
            state.view(-1).copy_(flat.to(state.device, state.dtype))
