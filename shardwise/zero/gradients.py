"""Gradient stores of the flat layouts: where ``param.grad`` lives under stages 0, 1 and 2.

Each is a ``GradientStore`` (``zero/buckets.py``) for the ``BucketReducer`` and
answers the partitioned step's questions about gradients (``owned_grads``,
``grad_of``).  Stage 3 has its own, ``UnitGradients`` in ``zero/stage3.py``.

* ``FlatGradients`` (stages 0 and 1): one persistent flat gradient buffer per
  group; ``param.grad`` are views of it, so accumulation across micro-steps is
  local and free; buckets are reduced in place at the accumulation boundary.
* ``PooledBucketGradients`` (stage 2): no full gradient buffer.  Each bucket,
  every backward, gets a short-lived buffer from a small pool whose views
  become the members' ``param.grad`` (autograd accumulates straight into it);
  once reduced, this rank's chunk is added to a partition-sized buffer and the
  bucket buffer goes back to the pool, which is emptied when backward ends.
"""

from __future__ import annotations

import torch

from shardwise.zero.buckets import Bucket
from shardwise.zero.flat import FlatGroup
from shardwise.zero.partitioned_step import Fragment


class FlatGradients:
    reduce_every_backward = False  # accumulate locally, reduce at the boundary
    max_in_flight = None

    def __init__(self, groups: list[FlatGroup], chunks: list[list[tuple[int, int]]] | None = None, *,
                 accum_dtype: torch.dtype | None = None) -> None:
        """``chunks[g]``: the buffer ranges of group ``g`` this rank owns (stage 1), or None: all (stage 0).
        ``accum_dtype`` (``data_types.grad_accum_dtype``): the buffers' dtype when it is not the parameters'.
        Then ``param.grad`` cannot be a view: each backward's gradient is added in and dropped."""
        self.groups = groups
        self.chunks = chunks
        self.buffers = [g.new_buffer(accum_dtype) for g in groups]
        self.views = [g.views(buf) for g, buf in zip(groups, self.buffers)]
        self.attach()

    def attach(self) -> None:
        """Point every ``param.grad`` at its view (someone may have replaced or dropped it)."""
        for g, views in zip(self.groups, self.views):
            if views and views[0].dtype != g.dtype:
                continue  # another accumulation dtype: accept() adds each gradient in
            for p, v in zip(g.params, views):
                p.grad = v

    def zero_(self) -> None:
        for buf in self.buffers:
            buf.zero_()
        self.attach()

    def backward_finished(self) -> None:
        """Nothing: the buffers persist."""

    # -- GradientStore ----------------------------------------------------------------------
    def storage(self, b: Bucket) -> torch.Tensor:
        return self.buffers[b.group_index][b.start : b.end]

    def accept(self, b: Bucket, i: int, p: torch.Tensor) -> None:
        view = self.views[b.group_index][i]
        if view.dtype != p.dtype:  # accumulate in the buffer's dtype
            view.add_(p.grad)
            p.grad = None
        elif p.grad is not view:  # someone set .grad (e.g. zero_grad(set_to_none=True)): take it back
            view.copy_(p.grad)
            p.grad = view

    def reduced(self, b: Bucket, own: torch.Tensor) -> None:
        """Nothing to do: the bucket was reduced in place in the flat buffer."""

    # -- for the step -----------------------------------------------------------------------
    def owned_grads(self) -> list[torch.Tensor]:
        if self.chunks is None:
            return list(self.buffers)
        return [buf[a:b] for buf, chunks in zip(self.buffers, self.chunks) for a, b in chunks]

    def grad_of(self, f: Fragment) -> torch.Tensor:
        return self.buffers[f.group][f.buffer_start : f.buffer_start + f.numel]

    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.buffers)

    def transient_bytes(self, reducer) -> int:
        return 0


class PooledBucketGradients:
    reduce_every_backward = True  # the full gradients do not outlive their bucket
    max_in_flight = 2

    def __init__(self, groups: list[FlatGroup], chunk_local: list[list[int]], world: int, *,
                 accum_dtype: torch.dtype | None = None) -> None:
        """``chunk_local[g][k]``: where this rank's chunk of bucket ``k`` of group ``g`` lies in its partition.
        ``accum_dtype``: the partitions' dtype (where micro-steps accumulate) when not the parameters'."""
        self.groups = groups
        self.chunk_local = chunk_local
        self.world = world
        self.partitions = [torch.zeros(g.partition_numel, dtype=accum_dtype or g.dtype, device=g.device)
                           for g in groups]
        self._spare: dict[tuple, list[torch.Tensor]] = {}

    def attach(self) -> None:
        """Nothing: ``param.grad`` are bucket views handed out as buckets are prepared."""

    def backward_finished(self) -> None:
        """Every bucket is reduced: the pool lives for one backward, nothing bucket-sized outlives it."""
        self._spare.clear()

    def zero_(self) -> None:
        for buf in self.partitions:
            buf.zero_()
        for g in self.groups:
            for p in g.params:
                p.grad = None

    # -- GradientStore ----------------------------------------------------------------------
    def storage(self, b: Bucket) -> torch.Tensor:
        g = self.groups[b.group_index]
        free = self._spare.get((b.numel, g.dtype))
        # Reuse a buffer a finished bucket gave back (fresh bucket storage every backward).
        data = free.pop().zero_() if free else torch.zeros(b.numel, dtype=g.dtype, device=g.device)
        # Members whose gradient is still to come get ``param.grad`` as a view of the bucket: autograd
        # then accumulates into it in place, and the gradient needs no copy.
        for i in b.members:
            p = g.params[i]
            if p.grad is None:
                off = g.offsets[i] - b.start
                p.grad = data[off : off + g.numels[i]].view_as(p)
        return data

    def accept(self, b: Bucket, i: int, p: torch.Tensor) -> None:
        g = self.groups[b.group_index]
        off = g.offsets[i] - b.start
        view = b.data[off : off + g.numels[i]]
        if p.grad.data_ptr() != view.data_ptr():  # arrived before its bucket had storage: copy it in
            view.copy_(p.grad.reshape(-1))
            p.grad = view.view_as(p)

    def reduced(self, b: Bucket, own: torch.Tensor) -> None:
        local = self.chunk_local[b.group_index][b.position]
        self.partitions[b.group_index][local : local + own.numel()].add_(own)
        g = self.groups[b.group_index]
        for i in b.members:  # the full gradient does not outlive its bucket
            g.params[i].grad = None
        spare = self._spare.setdefault((b.numel, b.data.dtype), [])
        if len(spare) < 2:
            spare.append(b.data)
        b.data = None

    # -- for the step -----------------------------------------------------------------------
    def owned_grads(self) -> list[torch.Tensor]:
        return list(self.partitions)

    def grad_of(self, f: Fragment) -> torch.Tensor:
        return self.partitions[f.group][f.local : f.local + f.numel]

    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.partitions)

    def transient_bytes(self, reducer) -> int:
        return reducer.transient_bytes(self.groups[0].param_buffer.element_size())
