"""Where a checkpoint's module weights (``model.safetensors``) come from.

``model.safetensors`` holds the whole module, in whole tensors, and rank 0 writes it. How rank 0
gets them depends on the layout (:class:`WeightsSource`):

* ``LOCAL``: rank 0 holds every layer (ZeRO-3 gathers each parameter; every rank takes part);
* ``TENSOR_RANKS``: tensor-sharded parameters are gathered over each tensor group (every rank takes part);
* ``PIPELINE_STAGES``: each stage holds its own layers, named by global layer index. Each stage's first
  data rank (gathered over its tensor group first) describes its tensors (names, dtypes, shapes) in a
  small object gather, then sends their bytes to rank 0 in one tensor message; rank 0 merges the stages
  in layer order. No tensor is pickled.

:func:`collect_module_weights` is collective over the world; it returns the weights on rank 0, None elsewhere.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from shardwise import comm
from shardwise.checkpoint import state as st
from shardwise.checkpoint import tensor_parallel as tpc
from shardwise.checkpoint.agreement import gather_object


class WeightsSource(enum.Enum):
    LOCAL = "local"
    TENSOR_RANKS = "tensor ranks"
    PIPELINE_STAGES = "pipeline stages"


def default_source(engine) -> WeightsSource:
    return WeightsSource.TENSOR_RANKS if tpc.view_of(engine).active else WeightsSource.LOCAL


@dataclass
class ModuleWeights:
    """Rank 0's view of the whole module, as the manifest describes it."""

    state: dict[str, torch.Tensor]  # whole tensors, by state-dict name
    keys: list[str]  # every state-dict name (tied aliases included), in the manifest's order
    aliases: dict[str, str]  # tied name -> the name whose tensor it is
    frozen: list[str]  # parameters that do not train
    topology: dict = field(default_factory=dict)  # what the manifest's "topology" adds (pipe_stages)


def collect_module_weights(engine, source: WeightsSource) -> ModuleWeights | None:
    """The whole module on rank 0 (None on the other ranks). Collective: every rank calls it."""
    if source is WeightsSource.PIPELINE_STAGES:
        return _from_stages(engine)
    tp = tpc.view_of(engine)
    gather = source is WeightsSource.TENSOR_RANKS
    assert gather or not tp.active, "tensor-sharded weights must come from WeightsSource.TENSOR_RANKS"
    rank = comm.get_rank()
    strategy = engine.strategy
    sd = strategy.module_state_dict(engine.module) \
        if (rank == 0 or strategy.gathers_module_state or gather) else None
    if gather:  # whole tensors: every tensor rank takes part
        sd = tpc.gather_state_dict(sd, tp)
    if rank != 0:
        return None
    aliases = st.tied_names(engine.module)
    keys = [k for k in engine.module.state_dict(keep_vars=True) if k in sd or k in aliases]
    known = set(keys)
    keys += [k for k in sd if k not in known]  # experts held by other expert-parallel ranks
    return ModuleWeights(state=sd, keys=keys, aliases=aliases, frozen=_frozen(engine.module))


def _frozen(module: torch.nn.Module) -> list[str]:
    return sorted(n for n, p in module.named_parameters() if not p.requires_grad)


def _layer_order(key: str):
    head = key.split(".", 1)[0]
    return (0, int(head), key) if head.isdigit() else (1, 0, key)


def _from_stages(engine) -> ModuleWeights | None:
    grid = engine.grid
    tp = tpc.view_of(engine)
    strategy = engine.strategy
    first_of_stage = grid.get_data_parallel_rank() == 0
    sd = strategy.module_state_dict(engine.module) if (first_of_stage or strategy.gathers_module_state) else None
    if first_of_stage:  # whole tensors (the tensor group of a first data rank is all first data ranks)
        sd = tpc.gather_state_dict(sd, tp)
    sender = first_of_stage and tp.rank == 0
    mine = None
    if sender:
        sd = {k: v.detach() for k, v in sd.items()}
        mine = ([(k, str(v.dtype).removeprefix("torch."), list(v.shape)) for k, v in sd.items()],
                _frozen(engine.module))
    described = gather_object(mine)  # names, dtypes and shapes only
    rank = comm.get_rank()
    device = _wire_device(engine)
    if rank != 0:
        packed = _pack(sd.values(), device) if sender else None
        if packed is not None and packed.numel():
            comm.send(packed, dst=0)
        return None
    merged, frozen = {}, set()
    for r, part in enumerate(described):
        if part is None:
            continue
        meta, stage_frozen = part
        merged.update(sd if r == 0 else _receive(meta, r, device))
        frozen.update(stage_frozen)
    merged = dict(sorted(merged.items(), key=lambda kv: _layer_order(kv[0])))
    return ModuleWeights(state=merged, keys=list(merged), aliases={}, frozen=sorted(frozen),
                         topology={"pipe_stages": grid.get_pipe_parallel_world_size()})


def _wire_device(engine) -> torch.device:
    """Where the bytes travel: the accelerator under NCCL, the CPU otherwise."""
    return torch.device(engine.device) if comm.get_backend() == "nccl" else torch.device("cpu")


def _pack(tensors, device) -> torch.Tensor:
    parts = [t.detach().to(device).contiguous().reshape(-1).view(torch.uint8) for t in tensors]
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8, device=device)


def _receive(meta: list, src: int, device) -> dict[str, torch.Tensor]:
    sizes = []
    for _, dtype, shape in meta:
        n = 1
        for d in shape:
            n *= d
        sizes.append(n * torch.empty((), dtype=getattr(torch, dtype)).element_size())
    buf = torch.empty(sum(sizes), dtype=torch.uint8, device=device)
    if buf.numel():
        comm.recv(buf, src=src)
    buf = buf.cpu()
    out, off = {}, 0
    for (name, dtype, shape), size in zip(meta, sizes):
        out[name] = buf[off:off + size].clone().view(getattr(torch, dtype)).reshape(shape)
        off += size
    return out
