"""A tensor split into contiguous flat pieces over the ranks of a group (DeepSpeed's ``PartitionedTensor``).

    part = PartitionedTensor(t, group)       # this rank keeps part.data(): its slice of t.flatten()
    meta = part.to_meta()                    # int64: [ndim, *shape, num_parts, rank, *boundaries]
    ...send meta and part.data() (pipeline stages pass activations this way)...
    again = PartitionedTensor.from_meta(meta, local_part, group)
    again.full()                             # the whole tensor, gathered from every rank (collective)

The flat tensor is cut with ``partition_uniform``: equal pieces, the first ``numel % parts`` one
element longer.
"""

from __future__ import annotations

import math

import torch

from shardwise import comm
from shardwise.pipe.partition import partition_uniform

__all__ = ["PartitionedTensor"]


def _default_device() -> str:
    from shardwise.accelerator import get_accelerator

    return get_accelerator().device_name()


class PartitionedTensor:
    """This rank's piece of ``tensor`` (the group's ranks each build one from the same tensor)."""

    def __init__(self, tensor: torch.Tensor, group=None, partition_meta=None) -> None:
        self.group = group
        self.num_parts = comm.get_world_size(group)
        self.rank = comm.get_rank(group)
        self.orig_size = list(tensor.size())
        self.orig_device = tensor.device
        self.partition = partition_uniform(tensor.numel(), self.num_parts)
        start, end = self.partition[self.rank], self.partition[self.rank + 1]
        self.local_data = tensor.detach().contiguous().view(-1)[start:end].clone()
        self.even_split = tensor.numel() % self.num_parts == 0

    @classmethod
    def from_meta(cls, meta: torch.Tensor, local_part: torch.Tensor, group=None, device=None):
        """Rebuild from ``to_meta()``'s encoding and this rank's piece; the group must be the one it was cut
        for (same size, and this rank's number in it)."""
        if meta.dtype != torch.long:
            raise ValueError(f"PartitionedTensor.from_meta: meta must be int64, got {meta.dtype}")
        values = meta.tolist()
        ndim = values[0]
        obj = cls.__new__(cls)
        obj.group = group
        obj.num_parts = comm.get_world_size(group)
        obj.rank = comm.get_rank(group)
        obj.orig_size = values[1:1 + ndim]
        num_parts, rank, boundaries = values[1 + ndim], values[2 + ndim], values[3 + ndim:]
        if (num_parts, rank) != (obj.num_parts, obj.rank):
            raise ValueError(f"PartitionedTensor.from_meta: cut for rank {rank} of {num_parts}, this is rank "
                             f"{obj.rank} of {obj.num_parts} in the group")
        obj.partition = boundaries
        obj.orig_device = device if device is not None else _default_device()
        obj.local_data = local_part.detach()
        obj.even_split = math.prod(obj.orig_size) % obj.num_parts == 0
        return obj

    def full(self, device=None) -> torch.Tensor:
        """The whole tensor on ``device`` (the original's by default): a collective over the group."""
        device = self.orig_device if device is None else device
        flat = torch.zeros(math.prod(self.orig_size), dtype=self.local_data.dtype, device=device)
        if self.even_split:
            comm.all_gather_into_tensor(flat, self.local_data.to(device), group=self.group)
        else:
            for part in range(self.num_parts):
                piece = flat[self.partition[part]:self.partition[part + 1]]
                if part == self.rank:
                    piece.copy_(self.local_data)
                comm.broadcast(piece, comm.get_global_rank(self.group, part), group=self.group)
        return flat.view(self.orig_size).clone()

    def to_meta(self) -> torch.Tensor:
        """``[ndim, *shape, num_parts, rank, *boundaries]`` as int64 on the original device."""
        meta = [len(self.orig_size), *self.orig_size, self.num_parts, self.rank, *self.partition]
        return torch.tensor(meta, dtype=torch.long, device=self.orig_device)

    def data(self) -> torch.Tensor:
        return self.local_data

    def local_size(self) -> torch.Size:
        return self.local_data.size()

    def full_size(self) -> list[int]:
        return self.orig_size
