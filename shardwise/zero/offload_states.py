"""Moving a ZeRO engine's model states off the accelerator and back: DeepSpeed's ``engine.offload_states()`` /
``engine.reload_states()`` and the names of the states (``OffloadStateTypeEnum``).

RLHF loops (OpenRLHF, verl) train a model, then give the accelerator to a generation engine, then train
again: between the phases the training engine's states go to host memory. Every state is a set of
tensor storages the strategy owns:

* ``lp_params``: the model's weights in the training dtype (stages 1-2: the flat parameter buffers whose
  views are ``param.data``; stage 3: each unit's shard, after releasing what is gathered);
* ``hp_params``: the fp32 master weights, where the optimizer steps a separate copy (16-bit training);
  with fp32 weights the optimizer steps the weights themselves, and they are ``lp_params``;
* ``lp_grads``: the gradients kept between micro-steps (stage 1: the flat gradient buffers; stages 2-3:
  this rank's gradient partitions);
* ``contiguous_grad_buffer``: the reduction buckets kept between backward passes (stage 2 with a
  ``reduce_bucket_size`` given); none elsewhere (they live for one backward);
* ``optim_states``: the optimizer's state tensors (Adam's moments, ...).

Offloading copies each storage into a host buffer (page-locked with ``pin_memory`` where an accelerator
is present) and shrinks the storage to zero bytes; every tensor and view of it (``param.data``,
``param.grad``, the optimizer's parameters and their state) stays the same Python object, so nothing has
to be re-pointed and the values come back bitwise: reloading grows the storage again on its device and
copies the bytes back. Only storages on the engine's device move (an optimizer already offloaded to the
CPU by ``offload_optimizer`` keeps its states where they are); on a CPU engine every storage is copied.
"""

from __future__ import annotations

from enum import Enum

import torch

__all__ = ["OffloadDeviceEnum", "OffloadStateTypeEnum", "OffloadStatesError", "StateOffload", "get_state_devices"]


class OffloadDeviceEnum(str, Enum):
    """Where offloaded states go (``deepspeed.runtime.zero.offload_config.OffloadDeviceEnum``)."""

    none = "none"
    cpu = "cpu"
    nvme = "nvme"


class OffloadStateTypeEnum(str, Enum):
    """The states ``offload_states(include=...)`` names (DeepSpeed's enum, same members and values)."""

    optim_states = "optim_states"
    hp_params = "hp_params"
    lp_params = "lp_params"
    lp_grads = "lp_grads"
    contiguous_grad_buffer = "contiguous_grad_buffer"


class OffloadStatesError(ValueError, AssertionError):
    """A refused ``offload_states`` / ``reload_states`` call: a ValueError (bad input) that is also the
    AssertionError DeepSpeed raises for the same cases (callers catch it by that type and wording)."""


def parse_include(include) -> list[OffloadStateTypeEnum]:
    """``include`` as a list of states (None: all), refusing names DeepSpeed does not have."""
    if include is None:
        return list(OffloadStateTypeEnum)
    items = [include] if isinstance(include, (str, OffloadStateTypeEnum)) else list(include)
    out = []
    for item in items:
        try:
            state = OffloadStateTypeEnum(item.value if isinstance(item, Enum) else item)
        except ValueError:
            raise OffloadStatesError(
                f"offload_states(include=...): {item!r} is not a state DeepSpeed offloads; the states are "
                f"{[s.value for s in OffloadStateTypeEnum]} (OffloadStateTypeEnum)") from None
        if state not in out:
            out.append(state)
    return out


def parse_device(device) -> OffloadDeviceEnum:
    try:
        return OffloadDeviceEnum(device.value if isinstance(device, Enum) else device)
    except ValueError:
        raise OffloadStatesError(f"offload_states(device={device!r}): the device is one of "
                                 f"{[d.value for d in OffloadDeviceEnum]} (OffloadDeviceEnum)") from None


class _Parked:
    """One storage whose bytes wait in a host buffer while the storage holds none."""

    def __init__(self, storage: torch.UntypedStorage, *, pin: bool, non_blocking: bool) -> None:
        self.storage, self.nbytes, self.device = storage, storage.nbytes(), storage.device
        self.host = torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=pin)
        self.host.copy_(_bytes_of(storage), non_blocking=non_blocking)
        storage.resize_(0)  # (stream-ordered: the allocator reuses the block only after the copy)

    def restore(self, *, non_blocking: bool) -> None:
        self.storage.resize_(self.nbytes)
        _bytes_of(self.storage).copy_(self.host, non_blocking=non_blocking)


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _strategies(strategy) -> list:
    return [strategy, *getattr(strategy, "strategies", ())]


def _state_tensors(engine, state: OffloadStateTypeEnum) -> list[torch.Tensor]:
    """The tensors holding ``state`` (views of one storage may repeat: callers dedupe by storage)."""
    out: list[torch.Tensor] = []
    for s in _strategies(engine.strategy):
        partition = getattr(s, "partition", None)
        grads = getattr(s, "gradients", None)
        if state is OffloadStateTypeEnum.lp_params:
            if s.shards_parameters:
                out += [u.shard for u in getattr(s, "units", ())]
            else:
                out += [g.param_buffer for g in getattr(s, "groups", ())]
        elif state is OffloadStateTypeEnum.hp_params:
            out += list(getattr(partition, "master_buffers", None) or ())
        elif state is OffloadStateTypeEnum.lp_grads and grads is not None:
            out += list(getattr(grads, "partitions", None) or getattr(grads, "buffers", None) or ())
        elif state is OffloadStateTypeEnum.contiguous_grad_buffer and grads is not None:
            out += [t for pool in getattr(grads, "_spare", {}).values() for t in pool]
    if state is OffloadStateTypeEnum.optim_states and engine.optimizer is not None:
        out += [v for st in engine.optimizer.state.values() for v in st.values() if torch.is_tensor(v)]
    return out


def _storages(tensors, device: torch.device) -> list[torch.UntypedStorage]:
    seen, out = set(), []
    for t in tensors:
        st = t.untyped_storage()
        if st.device != device or st.nbytes() == 0 or st._cdata in seen:
            continue
        seen.add(st._cdata)
        out.append(st)
    return out


class StateOffload:
    """What one engine has offloaded: ``{state: [parked storages]}``."""

    def __init__(self) -> None:
        self.parked: dict[OffloadStateTypeEnum, list[_Parked]] = {}

    def offload(self, engine, include, *, pin_memory: bool, non_blocking: bool) -> None:
        device = torch.device(engine.device)
        pin = bool(pin_memory) and device.type != "cpu" and torch.accelerator.is_available()
        for s in _strategies(engine.strategy):  # (ZeRO-3: gathered weights go; the next use gathers them again)
            coordinator = getattr(s, "coordinator", None) if s.shards_parameters else None
            if coordinator is not None:
                coordinator.release_all()
        for state in include:
            if state in self.parked:
                continue
            claimed = {p.storage._cdata for parked in self.parked.values() for p in parked}
            storages = [st for st in _storages(_state_tensors(engine, state), device) if st._cdata not in claimed]
            if state is OffloadStateTypeEnum.contiguous_grad_buffer:
                for s in _strategies(engine.strategy):  # buckets are made again when needed: dropped
                    getattr(getattr(s, "gradients", None), "_spare", {}).clear()
                storages = []
            self.parked[state] = [_Parked(st, pin=pin, non_blocking=non_blocking) for st in storages]
        if non_blocking and device.type != "cpu":
            torch.accelerator.synchronize()

    def reload(self, engine, *, non_blocking: bool) -> None:
        device = torch.device(engine.device)
        parked, self.parked = self.parked, {}
        for items in parked.values():
            for p in items:
                p.restore(non_blocking=non_blocking)
        if non_blocking and device.type != "cpu":  # (the host buffers are dropped after the copies finish)
            torch.accelerator.synchronize()

    def offloaded(self) -> set[OffloadStateTypeEnum]:
        return set(self.parked)

    def devices(self, engine, state: OffloadStateTypeEnum) -> set[torch.device]:
        parked = {p.storage._cdata for p in self.parked.get(state, ())}
        out = set()
        for t in _state_tensors(engine, state):
            st = t.untyped_storage()
            out.add(torch.device("cpu") if st._cdata in parked else t.device)
        return out


def get_state_devices(engine, state) -> set[torch.device]:
    """The devices where ``state`` of ``engine`` lives now (DeepSpeed's
    ``deepspeed.runtime.zero.offload_states.get_state_devices(model, state)``); offloaded: ``{cpu}``."""
    state = parse_include([state])[0]
    offload = engine.__dict__.get("_state_offload") or StateOffload()
    return offload.devices(engine, state)
