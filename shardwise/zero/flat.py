"""Flat buffers and partition arithmetic shared by every ZeRO stage.

A ``FlatGroup`` lays a list of same-dtype parameters end to end in one
contiguous buffer (padded so it splits evenly across ``world_size`` ranks) and
answers where each parameter lives.  Parameters, gradients, fp32 master
weights and optimizer states all use the same layout, so a rank's partition
is one range of the buffer and a checkpoint can describe any tensor as
(parameter name, offset range) fragments independent of the world size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Fragment:
    """The part of parameter ``index`` that lies inside a buffer range."""

    index: int  # position of the parameter in the group
    param_start: int  # offsets within the flattened parameter
    param_end: int
    buffer_start: int  # offsets within the flat buffer
    buffer_end: int


class FlatGroup:
    """Layout of ``params`` in one flat buffer, padded to a multiple of ``world_size``."""

    def __init__(self, params: list[torch.nn.Parameter], names: list[str], *, world_size: int = 1) -> None:
        if not params:
            raise ValueError("a flat group needs at least one parameter")
        dtypes = {p.dtype for p in params}
        devices = {p.device for p in params}
        assert len(dtypes) == 1 and len(devices) == 1, "a flat group holds one dtype on one device"
        self.params = list(params)
        self.names = list(names)
        self.dtype = params[0].dtype
        self.device = params[0].device
        self.numels = [p.numel() for p in params]
        self.offsets = []
        offset = 0
        for n in self.numels:
            self.offsets.append(offset)
            offset += n
        self.numel = offset
        self.world_size = world_size
        self.padded_numel = -(-offset // world_size) * world_size

    # -- buffers -------------------------------------------------------------------------
    def new_buffer(self, dtype: torch.dtype | None = None, device: torch.device | None = None) -> torch.Tensor:
        return torch.zeros(self.padded_numel, dtype=dtype or self.dtype, device=device or self.device)

    def views(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        """Per-parameter views of ``buffer`` shaped like the parameters."""
        return [
            buffer[off : off + n].view(p.shape) for p, off, n in zip(self.params, self.offsets, self.numels)
        ]

    def flatten_params_(self) -> torch.Tensor:
        """Move the parameters' storage into one flat buffer; each ``p.data`` becomes a view of it."""
        buffer = self.new_buffer()
        for p, view in zip(self.params, self.views(buffer)):
            view.copy_(p.detach())
            p.data = view
        self.param_buffer = buffer
        return buffer

    def cast_(self, dtype: torch.dtype) -> None:
        """Re-home the (already flattened) parameters in a buffer of ``dtype``."""
        buffer = self.param_buffer.to(dtype)
        for p, view in zip(self.params, self.views(buffer)):
            p.data = view
        self.param_buffer = buffer
        self.dtype = dtype

    # -- partitions ------------------------------------------------------------------------
    def partition_range(self, rank: int) -> tuple[int, int]:
        size = self.padded_numel // self.world_size
        return rank * size, (rank + 1) * size

    def fragments(self, start: int, end: int) -> list[Fragment]:
        """Every piece of a parameter that lies in ``[start, end)`` of the buffer."""
        out = []
        for i, (off, n) in enumerate(zip(self.offsets, self.numels)):
            lo, hi = max(start, off), min(end, off + n)
            if lo < hi:
                out.append(Fragment(i, lo - off, hi - off, lo, hi))
        return out

    def split_by_size(self, max_elements: int) -> list[tuple[int, int]]:
        """Cut the buffer into ranges of whole parameters of at most ``max_elements``
        (a single larger parameter gets a range of its own)."""
        ranges, start = [], 0
        for off, n in zip(self.offsets, self.numels):
            if off + n - start > max_elements and off > start:
                ranges.append((start, off))
                start = off
        ranges.append((start, self.padded_numel))
        return ranges


def group_by_dtype(named_params: list[tuple[str, torch.nn.Parameter]], *, world_size: int = 1) -> list[FlatGroup]:
    """One FlatGroup per (dtype, device), keeping the given order inside each."""
    buckets: dict[tuple, list[tuple[str, torch.nn.Parameter]]] = {}
    for name, p in named_params:
        buckets.setdefault((p.dtype, p.device), []).append((name, p))
    return [
        FlatGroup([p for _, p in items], [n for n, _ in items], world_size=world_size)
        for items in buckets.values()
    ]
