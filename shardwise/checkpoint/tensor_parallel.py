"""Tensor-sharded parameters in the universal checkpoint format.

A tensor-sharded parameter (``tensor_model_parallel=True``, cut along ``partition_dim`` d into tp
equal pieces) is described in the manifest by its *full* shape and ``"partition_dim": d``; its
fragments are flat ranges of the full tensor laid out with dimension d first
(``full.movedim(d, 0).flatten()``). In that layout tensor rank r's piece is the contiguous range
``[r * n, (r + 1) * n)`` (n = elements of one piece) whatever the tensor size, so a checkpoint saved
at one tensor size loads at any other (or at 1: the full tensor). For d = 0 the layout is the
ordinary flattening, so a piece's own flat ranges (ZeRO-1/2 partitions) map one to one; for d != 0
a partitioned stage first gathers the piece over the data-parallel group (collective) and data rank 0
writes it whole. ``model.safetensors`` and ``save_16bit_model`` hold full tensors (gathered over the
tensor group). Parameters without the attributes are replicated: tensor rank 0 writes them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from shardwise import comm


@dataclass
class TensorParallelView:
    size: int = 1
    rank: int = 0
    group: object = None
    partition_dims: dict[str, int] = field(default_factory=dict)  # locally sharded params (size > 1 only)

    @property
    def active(self) -> bool:
        return self.size > 1


def view_of(engine) -> TensorParallelView:
    grid = getattr(engine, "grid", None)
    size = int(grid.get_tensor_model_parallel_world_size()) if grid is not None and \
        hasattr(grid, "get_tensor_model_parallel_world_size") else 1
    if size == 1:
        return TensorParallelView()
    dims = {n: int(p.partition_dim) for n, p in engine.module.named_parameters()
            if getattr(p, "tensor_model_parallel", False)}
    strided = [n for n, p in engine.module.named_parameters() if getattr(p, "partition_stride", 1) != 1]
    if strided:  # e.g. GPT-2's fused c_attn under AutoTP: its pieces are not contiguous runs of the full tensor
        raise NotImplementedError(f"checkpoints of strided tensor-parallel parameters (partition_stride != 1: "
                                  f"{strided[:3]}) are not supported yet")
    return TensorParallelView(size=size, rank=int(grid.get_tensor_model_parallel_rank()),
                              group=grid.get_tensor_model_parallel_group(), partition_dims=dims)


def full_shape_of(local_shape, dim: int, size: int) -> list[int]:
    shape = list(local_shape)
    shape[dim] *= size
    return shape


def to_canonical(t: torch.Tensor, dim: int) -> torch.Tensor:
    """A piece (local shape) as its contiguous run of the dimension-``dim``-first layout."""
    return t.movedim(dim, 0).reshape(-1)


def from_canonical(flat: torch.Tensor, shape, dim: int) -> torch.Tensor:
    moved = [shape[dim]] + [s for i, s in enumerate(shape) if i != dim]
    return flat.reshape(moved).movedim(0, dim)


def gather_state_dict(sd: dict[str, torch.Tensor], tp: TensorParallelView) -> dict[str, torch.Tensor]:
    """Full tensors for the tensor-sharded entries of a module state dict (collective over the tensor
    group: every tensor rank calls it, entries in the same order)."""
    if not tp.active:
        return sd
    out = dict(sd)
    for name, dim in tp.partition_dims.items():
        if name not in sd:
            continue
        t = sd[name].detach().contiguous()
        parts = [torch.empty_like(t) for _ in range(tp.size)]
        torch.distributed.all_gather(parts, t, group=tp.group)
        out[name] = torch.cat(parts, dim=dim)
    return out


def shard_state_dict(state: dict[str, torch.Tensor], tp: TensorParallelView) -> dict[str, torch.Tensor]:
    """This tensor rank's pieces of full tensors (a checkpoint's module weights)."""
    if not tp.active:
        return state
    out = dict(state)
    for name, dim in tp.partition_dims.items():
        if name in state and state[name].shape[dim] % tp.size == 0:
            out[name] = state[name].chunk(tp.size, dim=dim)[tp.rank].contiguous()
    return out


def read_local(reader, entry: dict, name: str, local_shape, start: int, end: int, tp: TensorParallelView, *,
               what: str) -> torch.Tensor:
    """Elements ``[start, end)`` of this rank's (flattened) piece of ``name``, from a manifest entry
    written at any tensor size."""
    saved_dim = entry.get("partition_dim")
    local_dim = tp.partition_dims.get(name)
    if saved_dim is None and local_dim is None:
        return reader.read_range(entry, start, end, what=what)
    full = list(entry["shape"])
    size, rank = (tp.size, tp.rank) if local_dim is not None else (1, 0)
    dim = local_dim if local_dim is not None else saved_dim
    n = 1
    for s in local_shape:
        n *= s
    if (saved_dim or 0) == dim:
        if dim == 0:  # the piece's own flattening is a contiguous run of the saved layout
            return reader.read_range(entry, rank * n + start, rank * n + end, what=what)
        piece = reader.read_range(entry, rank * n, (rank + 1) * n, what=what)
        return from_canonical(piece, list(local_shape), dim).reshape(-1)[start:end]
    total = 1
    for s in full:
        total *= s
    whole = from_canonical(reader.read_range(entry, 0, total, what=what), full, saved_dim or 0)
    return whole.chunk(size, dim=dim)[rank].reshape(-1)[start:end]


def gather_piece(strategy, name: str, shape, what: str) -> torch.Tensor:
    """This tensor rank's whole piece of ``name`` (param or optimizer state ``what``), assembled over the
    data-parallel group (collective for partitioned stages)."""
    return strategy.gather_full(name, torch.Size(shape), what)


def world_union(keys: set[str]) -> list[str]:
    """The union over all ranks of optimizer state names (collective)."""
    if comm.get_world_size() == 1:
        return sorted(keys)
    parts = [None] * comm.get_world_size()
    torch.distributed.all_gather_object(parts, sorted(keys))
    return sorted(set().union(*map(set, parts)))
