"""Per-parameter sharding for ZeRO stage 3.

A parameter of ``n`` elements is split into N chunks of ``c = ceil(n / N)``
elements; rank r keeps chunk r (``[r*c, min((r+1)*c, n))``, zero-padded to
``c``).  The full tensor exists only while a module needs it: ``param.data``
is then a view of a gathered buffer, otherwise an empty tensor.

``ShardedParam`` holds that state on the parameter itself (``param._sw``), so
``zero.Init`` can shard parameters as modules are constructed, before any
engine or global layout exists.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from shardwise import comm


@dataclass
class ShardedParam:
    shape: torch.Size
    numel: int
    chunk: int  # elements per rank, padded
    shard: torch.Tensor  # this rank's chunk (model dtype)
    rank: int
    world: int

    @property
    def owned(self) -> tuple[int, int]:
        """The ``[start, end)`` elements of the flattened parameter this rank holds (may be empty)."""
        start = min(self.rank * self.chunk, self.numel)
        return start, min(start + self.chunk, self.numel)


def shard_param_(param: torch.nn.Parameter, *, group=None, src_rank: int = 0, broadcast: bool = True) -> ShardedParam:
    """Keep only this rank's chunk of ``param`` (after making every rank's copy equal to ``src_rank``'s)."""
    world, rank = comm.get_world_size(group), comm.get_rank(group)
    data = param.data
    if broadcast and world > 1:
        src = src_rank if group is None else torch.distributed.get_global_rank(group, src_rank)
        comm.broadcast(data, src=src, group=group)
    numel = data.numel()
    chunk = -(-numel // world) if numel else 0
    flat = data.reshape(-1)
    shard = torch.zeros(chunk, dtype=data.dtype, device=data.device)
    start = min(rank * chunk, numel)
    end = min(start + chunk, numel)
    shard[: end - start].copy_(flat[start:end])
    meta = ShardedParam(data.shape, numel, chunk, shard, rank, world)
    param._sw = meta
    param.data = torch.empty(0, dtype=data.dtype, device=data.device)
    return meta


def is_sharded(param: torch.Tensor) -> bool:
    return getattr(param, "_sw", None) is not None


def _resident(meta: ShardedParam, *, write: bool):
    unit = getattr(meta, "unit", None)  # a stage-3 unit may keep the shard on disk
    return unit.resident(write=write) if unit is not None else contextlib.nullcontext()


def gather_full(param: torch.nn.Parameter, *, group=None) -> torch.Tensor:
    """A freshly gathered full copy of a sharded parameter (collective)."""
    meta: ShardedParam = param._sw
    with _resident(meta, write=False):
        out = torch.empty(meta.chunk * meta.world, dtype=meta.shard.dtype, device=meta.shard.device)
        if meta.world > 1:
            comm.all_gather_into_tensor(out, meta.shard, group=group)
        else:
            out.copy_(meta.shard)
    return out[: meta.numel].view(meta.shape)


def scatter_full_(param: torch.nn.Parameter, full: torch.Tensor) -> None:
    """Write this rank's chunk of ``full`` back into the shard."""
    meta: ShardedParam = param._sw
    start, end = meta.owned
    with _resident(meta, write=True), torch.no_grad():
        meta.shard[: end - start].copy_(full.reshape(-1)[start:end])
