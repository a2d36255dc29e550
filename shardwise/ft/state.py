"""The live state a replica group takes from a healthy peer when it joins or rejoins.

Every rank of a replica group exchanges state with the rank of the same group rank in the peer group
(torchft pairs them; each rank serves its own state over torchft's HTTP checkpoint transport). Replica
groups run the same config on the same number of processes, so the two ranks hold the same pieces: the
exchange is a list of tensors copied in place, in a fixed order, plus the small settings.

What is carried (``capture``) and put back (``restore``):

* weights: the module's parameters and buffers, the ZeRO strategy's flat weight storage (stage 0-2
  buffers, stage 3 shards) and the fp32 master fragments the optimizer steps;
* the optimizer: each parameter's state tensors (Adam's moments, step) and each group's settings;
* the learning-rate scheduler, the fp16 loss scaler, the engine's step counters;
* the data position of the engine's training loader (``engine.training_dataloader``);
* whatever the script registered with ``engine.fault_tolerance.register_state``.

The RNG streams are not carried: they belong to a replica group (dropout masks differ per group anyway).
"""

from __future__ import annotations

import copy
from dataclasses import asdict

import torch

from shardwise.training_state import StepCounters

from . import FaultToleranceError

FORMAT = 1


def _strategies(strategy) -> list:
    return [strategy, *getattr(strategy, "strategies", ())]


def weight_tensors(engine) -> list[torch.Tensor]:
    """Every tensor holding weights on this rank, in an order the same on every replica group."""
    out = [t for t in engine.module.state_dict(keep_vars=True).values() if isinstance(t, torch.Tensor)]
    for s in _strategies(engine.strategy):
        for g in getattr(s, "groups", None) or ():
            buf = getattr(g, "param_buffer", None)
            if isinstance(buf, torch.Tensor):
                out.append(buf)
        for u in getattr(s, "units", None) or ():
            if isinstance(getattr(u, "shard", None), torch.Tensor):
                out.append(u.shard)
        out.extend(getattr(s, "master_buffers", None) or ())
        partition = getattr(s, "partition", None)
        out.extend(getattr(partition, "master_buffers", None) or ())
        out.extend(t for _, _, _, t in s.local_fragments())
    return out


def _optimizer_params(optimizer) -> list[torch.Tensor]:
    return [p for g in optimizer.param_groups for p in g["params"]]


def _detached(value, clone: bool):
    if isinstance(value, torch.Tensor):
        value = value.detach()
        return value.clone() if clone else value
    return copy.deepcopy(value)


def capture(engine, extra: dict | None = None) -> dict:
    """This rank's live state (tensors cloned on CPU, where the HTTP transport would serve the live
    tensors themselves)."""
    from shardwise.checkpoint.state import data_position

    clone = True
    state = {"format": FORMAT, "weights": [_detached(t, clone) for t in weight_tensors(engine)]}
    opt = engine.optimizer
    if opt is not None:
        state["optimizer"] = {
            "state": [{k: _detached(v, clone) for k, v in opt.state.get(p, {}).items()} for p in _optimizer_params(opt)],
            "groups": [{k: copy.deepcopy(v) for k, v in g.items() if k != "params"} for g in opt.param_groups],
        }
    sched = engine.lr_scheduler
    state["scheduler"] = sched.state_dict() if sched is not None and hasattr(sched, "state_dict") else None
    state["loss_scaler"] = engine.loss_scaler.state_dict() if engine.loss_scaler is not None else None
    state["counters"] = asdict(engine.train_step.counters())
    state["data"] = data_position(engine)
    state["extra"] = extra or {}
    return state


def restore(engine, state: dict) -> dict:
    """Put a peer's ``capture`` into ``engine`` in place; returns the script's registered extras."""
    from shardwise.checkpoint.state import restore_data_position

    if state.get("format") != FORMAT:
        raise FaultToleranceError(f"a peer sent live state of format {state.get('format')!r}, this rank reads {FORMAT}")
    own = weight_tensors(engine)
    theirs = state["weights"]
    if len(own) != len(theirs) or any(a.shape != b.shape for a, b in zip(own, theirs)):
        raise FaultToleranceError(
            f"the live state of the peer replica group does not fit this one ({len(theirs)} weight tensors, "
            f"this rank has {len(own)}): every replica group must run the same model, config and number of processes")
    with torch.no_grad():
        for dst, src in zip(own, theirs):
            dst.copy_(src)
    opt = engine.optimizer
    if opt is not None and "optimizer" in state:
        params = _optimizer_params(opt)
        saved = state["optimizer"]
        if len(saved["state"]) != len(params) or len(saved["groups"]) != len(opt.param_groups):
            raise FaultToleranceError("the peer replica group's optimizer has other parameters than this one's")
        for p, pstate in zip(params, saved["state"]):
            if pstate:
                opt.state[p] = {k: (v.to(p.device) if isinstance(v, torch.Tensor) and v.dim() > 0 else v)
                                for k, v in pstate.items()}
            else:
                opt.state.pop(p, None)
        for group, hyper in zip(opt.param_groups, saved["groups"]):
            group.update(hyper)
    if state["scheduler"] is not None and engine.lr_scheduler is not None:
        engine.lr_scheduler.load_state_dict(state["scheduler"])
    if state["loss_scaler"] is not None and engine.loss_scaler is not None:
        engine.loss_scaler.load_state_dict(state["loss_scaler"])
    engine.train_step.restore(StepCounters(**state["counters"]))
    restore_data_position(engine, state["data"])
    return state["extra"]
