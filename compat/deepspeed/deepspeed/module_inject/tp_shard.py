"""``deepspeed.module_inject.tp_shard``: how DeepSpeed's AutoTP cuts a dimension over the tensor ranks, which is
shardwise's (``shardwise.tensor_parallel.sharding``: ``shard_widths``, ``HeadCounts``).

``get_shard_size_list(total, tp, meta, name)`` is the width of each rank's piece: whole key/value heads
when the model's head count divides the dimension (attention projections), else near-even pieces in
multiples of ``meta.tp_grain_size`` with the remainder on the last rank. The pieces may be unequal
(a vocabulary of 101 over 2 ranks: 51 and 50); shardwise's own AutoTP refuses an uneven split, and the
layers of ``deepspeed.module_inject.layers`` refuse to materialise one (see there).
"""

from __future__ import annotations

from shardwise import comm
from shardwise.tensor_parallel.sharding import HeadCounts as AutoTPMeta  # DeepSpeed's name for the head counts
from shardwise.tensor_parallel.sharding import shard_width, shard_widths

__all__ = ["AutoTPMeta", "get_shard_size", "get_shard_size_list"]


def get_shard_size(total_size: int, mp_size: int, meta: AutoTPMeta | None = None, name=None, rank=None,
                   mp_group=None) -> int:
    """The width of tensor rank ``rank``'s piece (``rank`` within the group; default: this process's)."""
    if rank is None:
        if mp_group is None and comm.get_world_size() != mp_size:
            raise ValueError(f"get_shard_size: pass rank= or mp_group= when mp_size ({mp_size}) is not the world "
                             f"size ({comm.get_world_size()})")
        rank = comm.get_rank(mp_group)
    return shard_width(total_size, mp_size, rank, meta, name)


def get_shard_size_list(total_size: int, mp_size: int, meta: AutoTPMeta | None = None, name=None) -> list[int]:
    """The width of every tensor rank's piece of a dimension of ``total_size``; they add up to it."""
    return shard_widths(total_size, mp_size, meta, name)
