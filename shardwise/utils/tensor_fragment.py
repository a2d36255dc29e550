"""Stage-independent access to whole parameters, gradients and optimizer states
(``deepspeed.utils.tensor_fragment``).

Under ZeRO a rank holds only its share of the fp32 weights, gradients and
optimizer state; these functions assemble the whole tensor of one model
parameter from every rank (DeepSpeed's ``deepspeed.utils.safe_get_full_*``).
With a partitioned stage they are collective: call them on every rank.
"""

from __future__ import annotations

import torch

__all__ = ["safe_get_full_fp32_param", "safe_get_full_grad", "safe_get_full_optimizer_state",
           "safe_set_full_fp32_param", "safe_set_full_optimizer_state"]


def _owner(param: torch.nn.Parameter):
    ref = getattr(param, "_shardwise_owner", None)
    engine = ref[0]() if ref is not None else None
    if engine is None:
        raise ValueError("this parameter does not belong to a model wrapped by shardwise.initialize()")
    return engine, ref[1]


def safe_get_full_fp32_param(param: torch.nn.Parameter) -> torch.Tensor:
    """The fp32 (master) weights of ``param``, whole."""
    engine, name = _owner(param)
    if not param.requires_grad:  # frozen: no master copy, the (possibly sharded) weight itself
        from shardwise.zero.partitioned_param import gather_full, is_sharded

        return (gather_full(param, group=engine.dp_group) if is_sharded(param) else param.detach()).float()
    return engine.strategy.gather_full(name, _shape(param), "param")


def safe_get_full_grad(param: torch.nn.Parameter) -> torch.Tensor:
    """The reduced gradient of ``param`` (after ``engine.backward`` at an accumulation boundary,
    before ``engine.step``), unscaled, in fp32."""
    engine, name = _owner(param)
    grad = engine.strategy.gather_full(name, _shape(param), "grad")
    return grad / engine.cur_scale if engine.cur_scale != 1.0 else grad


def safe_get_full_optimizer_state(param: torch.nn.Parameter, optim_state_key: str) -> torch.Tensor:
    """One per-element optimizer state of ``param`` (e.g. ``"exp_avg"``), whole, in fp32."""
    engine, name = _owner(param)
    return engine.strategy.gather_full(name, _shape(param), optim_state_key)


def _shape(param: torch.nn.Parameter) -> torch.Size:
    meta = getattr(param, "_sw", None)  # stage 3: the parameter's own data may be released
    return meta.shape if meta is not None else param.shape


def safe_set_full_fp32_param(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    """Set the fp32 (master) weights of ``param`` to ``value`` (the whole tensor, on every rank);
    the model's (possibly 16-bit, possibly sharded) weights follow. Call it on every rank."""
    engine, name = _owner(param)
    full = _whole(param, value)
    from shardwise.zero.partitioned_param import is_sharded, scatter_full_

    if param.requires_grad:
        _write_fragments(engine, name, full, state_key=None)
    with torch.no_grad():
        if is_sharded(param):
            scatter_full_(param, full.to(param._sw.shard.dtype))
        else:
            param.data.copy_(full.view(param.shape).to(param.dtype))


def safe_set_full_optimizer_state(param: torch.nn.Parameter, value: torch.Tensor, optim_state_key: str) -> None:
    """Set one per-element optimizer state of ``param`` (e.g. ``"exp_avg"``) to ``value`` (whole)."""
    engine, name = _owner(param)
    _write_fragments(engine, name, _whole(param, value), state_key=optim_state_key)


def _whole(param: torch.nn.Parameter, value: torch.Tensor) -> torch.Tensor:
    shape = _shape(param)
    if tuple(value.shape) != tuple(shape):
        raise ValueError(f"value has shape {tuple(value.shape)}, the parameter has shape {tuple(shape)}")
    return value.detach().reshape(-1).float()


def _write_fragments(engine, name: str, full: torch.Tensor, *, state_key: str | None) -> None:
    from shardwise.zero.strategy import ZeroStrategy

    strategy = engine.strategy
    if type(strategy).fragment_batches is not ZeroStrategy.fragment_batches:
        raise NotImplementedError("safe_set_full_*: not supported with the optimizer offloaded to NVMe")
    with torch.no_grad():
        for fname, start, end, t in strategy.local_fragments():
            if fname != name:
                continue
            if state_key is None:
                t.view(-1).copy_(full[start:end].to(t.device))
                continue
            state = engine.optimizer.state.get(t, {}) if engine.optimizer is not None else {}
            if state_key not in state:
                raise KeyError(f"no optimizer state '{state_key}' for {name} (has the optimizer stepped yet?)")
            state[state_key].view(-1).copy_(full[start:end].to(state[state_key].device))
