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
    strides: dict[str, int] = field(default_factory=dict)  # partition_stride where it is not 1

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
    strides = {n: int(getattr(p, "partition_stride", 1)) for n, p in engine.module.named_parameters()
               if n in dims and int(getattr(p, "partition_stride", 1)) != 1}
    return TensorParallelView(size=size, rank=int(grid.get_tensor_model_parallel_rank()),
                              group=grid.get_tensor_model_parallel_group(), partition_dims=dims, strides=strides)


def piece_of(full: torch.Tensor, dim: int, stride: int, size: int, rank: int) -> torch.Tensor:
    """Tensor rank ``rank``'s piece of ``full``: with Megatron's strided layout (``partition_stride`` s)
    the dimension is cut into s * size chunks and rank r holds chunks r, r + size, ..., concatenated."""
    if stride == 1:
        return full.chunk(size, dim=dim)[rank]
    chunks = full.chunk(stride * size, dim=dim)
    return torch.cat([chunks[j * size + rank] for j in range(stride)], dim=dim)


def assemble(pieces: list[torch.Tensor], dim: int, stride: int) -> torch.Tensor:
    """The full tensor from every tensor rank's piece (inverse of ``piece_of``)."""
    if stride == 1:
        return torch.cat(pieces, dim=dim)
    parts = [p.chunk(stride, dim=dim) for p in pieces]
    return torch.cat([parts[r][j] for j in range(stride) for r in range(len(pieces))], dim=dim)


def piece_runs(piece: torch.Tensor, dim: int, stride: int, size: int, rank: int):
    """``(start, end, data)``: where a whole piece (local shape) lies in the saved dimension-first layout
    of the full tensor: one run, or ``stride`` runs."""
    flat = to_canonical(piece, dim)
    c = flat.numel() // stride
    return [((j * size + rank) * c, (j * size + rank + 1) * c, flat[j * c:(j + 1) * c]) for j in range(stride)]


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
        out[name] = assemble(parts, dim, tp.strides.get(name, 1))
    return out


def shard_state_dict(state: dict[str, torch.Tensor], tp: TensorParallelView) -> dict[str, torch.Tensor]:
    """This tensor rank's pieces of full tensors (a checkpoint's module weights)."""
    if not tp.active:
        return state
    out = dict(state)
    for name, dim in tp.partition_dims.items():
        stride = tp.strides.get(name, 1)
        if name in state and state[name].shape[dim] % (tp.size * stride) == 0:
            out[name] = piece_of(state[name], dim, stride, tp.size, tp.rank).contiguous()
    return out


def read_local(reader, entry: dict, name: str, local_shape, start: int, end: int, tp: TensorParallelView, *,
               what: str) -> torch.Tensor:
    """Elements ``[start, end)`` of this rank's (flattened) piece of ``name``, from a manifest entry
    written at any tensor size and stride (the saved layout depends only on ``partition_dim``)."""
    saved_dim = entry.get("partition_dim")
    local_dim = tp.partition_dims.get(name)
    if saved_dim is None and local_dim is None:
        return reader.read_range(entry, start, end, what=what)
    full = list(entry["shape"])
    size, rank = (tp.size, tp.rank) if local_dim is not None else (1, 0)
    stride = tp.strides.get(name, 1) if local_dim is not None else 1
    dim = local_dim if local_dim is not None else saved_dim
    n = 1
    for s in local_shape:
        n *= s
    if (saved_dim or 0) == dim:  # the piece is `stride` contiguous runs of the saved layout
        if dim == 0 and stride == 1:  # ... and its own flattening is that run
            return reader.read_range(entry, rank * n + start, rank * n + end, what=what)
        c = n // stride
        runs = [reader.read_range(entry, (j * size + rank) * c, (j * size + rank + 1) * c, what=what)
                for j in range(stride)]
        piece = runs[0] if stride == 1 else torch.cat([r.reshape(-1) for r in runs])
        return from_canonical(piece, list(local_shape), dim).reshape(-1)[start:end]
    total = 1
    for s in full:
        total *= s
    whole = from_canonical(reader.read_range(entry, 0, total, what=what), full, saved_dim or 0)
    return piece_of(whole, dim, stride, size, rank).reshape(-1)[start:end]


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
