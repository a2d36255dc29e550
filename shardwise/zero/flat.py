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
    """Layout of ``params`` in one flat buffer, cut into buckets of whole parameters.

    Each bucket holds at most ``bucket_elements`` elements (a single larger
    parameter gets a bucket of its own) and is padded to a multiple of
    ``world_size``, so rank ``r`` owns the ``r``-th equal chunk of every bucket:
    a bucket can be reduce-scattered and all-gathered in place.
    """

    def __init__(self, params: list[torch.nn.Parameter], names: list[str], *, world_size: int = 1,
                 bucket_elements: int | None = None, domain=None) -> None:
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
        self.world_size = world_size
        self.domain = domain  # the ``ReduceDomain`` its buckets reduce over (``zero/buckets.py``; None: the data group)
        limit = bucket_elements if bucket_elements and bucket_elements > 0 else sum(self.numels)
        self.offsets: list[int] = []
        self.buckets: list[tuple[int, int]] = []  # padded [start, end) of each bucket
        self.bucket_members: list[list[int]] = []
        offset = bucket_start = 0
        members: list[int] = []
        for i, n in enumerate(self.numels):
            if members and offset + n - bucket_start > limit:
                offset = self._close_bucket(bucket_start, offset, members)
                bucket_start, members = offset, []
            self.offsets.append(offset)
            members.append(i)
            offset += n
        self.padded_numel = self._close_bucket(bucket_start, offset, members)
        self.numel = sum(self.numels)
        self.partition_numel = self.padded_numel // world_size

    def _close_bucket(self, start: int, end: int, members: list[int]) -> int:
        padded_end = start + -(-(end - start) // self.world_size) * self.world_size
        self.buckets.append((start, padded_end))
        self.bucket_members.append(members)
        return padded_end

    def rank_chunks(self, rank: int) -> list[tuple[int, int]]:
        """The ``[start, end)`` buffer range rank ``rank`` owns in each bucket."""
        out = []
        for start, end in self.buckets:
            size = (end - start) // self.world_size
            out.append((start + rank * size, start + (rank + 1) * size))
        return out

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
    def fragments(self, start: int, end: int) -> list[Fragment]:
        """Every piece of a parameter that lies in ``[start, end)`` of the buffer."""
        out = []
        for i, (off, n) in enumerate(zip(self.offsets, self.numels)):
            lo, hi = max(start, off), min(end, off + n)
            if lo < hi:
                out.append(Fragment(i, lo - off, hi - off, lo, hi))
        return out


def group_by_dtype(named_params: list[tuple[str, torch.nn.Parameter]], *, world_size: int = 1,
                   bucket_elements: int | None = None, domain=None) -> list[FlatGroup]:
    """One FlatGroup per (dtype, device), keeping the given order inside each; ``domain``: the
    ``ReduceDomain`` all of them reduce over."""
    buckets: dict[tuple, list[tuple[str, torch.nn.Parameter]]] = {}
    for name, p in named_params:
        buckets.setdefault((p.dtype, p.device), []).append((name, p))
    return [
        FlatGroup([p for _, p in items], [n for n, _ in items], world_size=world_size,
                  bucket_elements=bucket_elements, domain=domain)
        for items in buckets.values()
    ]
