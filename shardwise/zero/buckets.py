"""Bucketed gradient reduction launched from autograd hooks, shared by ZeRO stages 0-2.

Every trainable parameter gets a post-accumulate-grad hook.  The hook hands
the parameter's gradient to its bucket; when a bucket has every member it
starts an asynchronous collective at once, so communication overlaps the rest
of backward.  Buckets start strictly in index order (a complete bucket waits
for its predecessors), which keeps the collective sequence identical on every
rank even if autograd's order differs between them.

Where a bucket's data lives is the business of a ``GradientStore``, one per
gradient layout (below: a persistent flat buffer for stages 0 and 1, pooled
short-lived bucket buffers for stage 2; ``zero/stage3.py``: the units of
stage 3).  The reducer calls it three times per bucket, always in
this direction: ``storage(bucket)`` when the bucket is next to fill (before its
own gradients arrive), ``accept(bucket, i, param)`` when a member's gradient is
final, and ``reduced(bucket, own)`` once the reduction is done.

The gradient stores of the flat layouts (where ``param.grad`` lives under stages
0, 1 and 2) are in this file too.  Each is a ``GradientStore`` for the
``BucketReducer`` and answers the partitioned step's questions about gradients (``owned_grads``,
``grad_of``).  Stage 3 has its own, ``UnitGradients`` in ``zero/stage3.py``.

* ``FlatGradients`` (stages 0 and 1): one persistent flat gradient buffer per
  group; ``param.grad`` are views of it, so accumulation across micro-steps is
  local and free; buckets are reduced in place at the accumulation boundary.
* ``PooledBucketGradients`` (stage 2): no full gradient buffer.  Each bucket,
  every backward, gets a short-lived buffer from a small pool whose views
  become the members' ``param.grad`` (autograd accumulates straight into it);
  once reduced, this rank's chunk is added to a partition-sized buffer and the
  bucket buffer goes back to the pool, which is emptied when backward ends
  (kept for the next backward when the config gives ``reduce_bucket_size``).
"""

from __future__ import annotations

import weakref
from collections import deque
from typing import TYPE_CHECKING, Protocol

import torch

from shardwise import comm
from shardwise.comm import direct
from shardwise.param_attrs import GRAD_IS_READY
from shardwise.zero.flat import FlatGroup
from shardwise.zero.strategy import ReduceSettings

if TYPE_CHECKING:
    from shardwise.zero.partitioned_step import Fragment


class GradientStore(Protocol):
    """Where gradients live while they are reduced: one implementation per layout."""

    reduce_every_backward: bool  # True: reduce on every backward (stages 2-3), not only at the boundary
    max_in_flight: int | None  # buckets reduced at once before the oldest is completed (None: no bound)

    def storage(self, bucket: Bucket) -> torch.Tensor:
        """The tensor that will hold ``bucket``'s gradients (called before they arrive)."""

    def accept(self, bucket: Bucket, index: int, param: torch.Tensor) -> None:
        """Parameter ``index`` of the bucket's group has its final ``param.grad``: move it into the bucket."""

    def reduced(self, bucket: Bucket, own: torch.Tensor) -> None:
        """The bucket's reduction is done; ``own`` is this rank's chunk of the result."""


class Bucket:
    def __init__(self, index: int, group_index: int, position: int, start: int, end: int,
                 members: list[int]) -> None:
        self.index = index
        self.group_index = group_index
        self.position = position  # index among its group's buckets
        self.start, self.end = start, end
        self.members = members  # parameter indices inside the group
        self.pending = len(members)
        self.data: torch.Tensor | None = None  # the bucket's gradients (from ``GradientStore.storage``)
        self.work = None
        self.comm_buffer: torch.Tensor | None = None  # a cast copy when communication_data_type differs

    @property
    def numel(self) -> int:
        return self.end - self.start


class BucketReducer:
    """Reduce gradients bucket by bucket with ``all_reduce`` or in-place ``reduce_scatter``.

    The ``store`` (a ``GradientStore``) says where each bucket's gradients live.
    ``dp_group`` is the data-parallel process group reduced over (``None``: the world).
    With ``scatter`` the result is only this rank's chunk of each bucket.
    ``on_reduced(bucket)``, if given, is called once a bucket's reduction is complete and stored.
    Each bucket reduces over its flat group's ``domain`` (``zero/layout.py``: MoE experts over their
    expert-data-parallel group, times the domain's ``grad_scale``); or, given, ``bucket_groups`` and
    ``bucket_scales`` per bucket (stage 3's units); ``dp_group`` otherwise.
    ``reduce_scatter(bucket, out, data, group)``, if given, replaces ``comm.reduce_scatter_tensor`` for the
    scatter (ZeRO++'s quantized hierarchical one); it returns a handle with ``wait()``.
    """

    def __init__(self, groups: list[FlatGroup], store: GradientStore, *, reduce: ReduceSettings, dp_group,
                 scatter: bool, on_reduced=None, bucket_groups: list | None = None, before_launch=None,
                 bucket_scales: list[float] | None = None, reduce_scatter=None) -> None:
        self.groups = groups
        self.store = store
        self.reduce = reduce
        self.dp_group = dp_group
        self.world = comm.get_world_size(dp_group)
        self.rank = comm.get_rank(dp_group)
        self.scatter = scatter
        self.reduce_scatter = reduce_scatter
        self.max_in_flight = store.max_in_flight
        self.buckets: list[Bucket] = []
        self._bucket_of: dict[int, Bucket] = {}
        for gi, g in enumerate(groups):
            for pos, ((start, end), members) in enumerate(zip(g.buckets, g.bucket_members)):
                b = Bucket(len(self.buckets), gi, pos, start, end, members)
                self.buckets.append(b)
                for i in members:
                    self._bucket_of[id(g.params[i])] = b
        self._comm = [(dp_group, self.world, self.rank)] * len(self.buckets)  # (group, world, rank) per bucket
        if bucket_groups is not None:
            self._comm = [(g, comm.get_world_size(g), comm.get_rank(g)) for g in bucket_groups]
        else:
            domains = [getattr(groups[b.group_index], "domain", None) for b in self.buckets]
            self._comm = [c if d is None else (d.group, d.world, d.rank) for c, d in zip(self._comm, domains)]
            bucket_scales = [1.0 if d is None else d.grad_scale for d in domains]
        self._scale = list(bucket_scales) if bucket_scales is not None else [1.0] * len(self.buckets)
        # whether a backward has anything to reduce or scale (False: every bucket is this rank's alone)
        self.needed = any(c[1] > 1 for c in self._comm) or any(x != 1.0 for x in self._scale)
        self.active = False
        self.on_reduced = on_reduced  # called with each bucket once its reduction is complete (and stored)
        self.before_launch = before_launch  # called with each bucket right before its collective starts
        self._launched = 0
        self._arrived: set[tuple[int, int]] = set()
        self.seen: set[tuple[int, int]] = set()  # (group, parameter) with a gradient since the owner cleared it
        self._in_flight: deque[Bucket] = deque()
        self._hooks = [
            p.register_post_accumulate_grad_hook(_weak_hook(self, gi, i))
            for gi, g in enumerate(groups)
            for i, p in enumerate(g.params)
        ]
        # (the hooks hold the reducer weakly: a parameter keeps no strategy alive, and the hooks go with it)
        self._finalizer = weakref.finalize(self, _remove_all, self._hooks)

    def close(self) -> None:
        """Take the gradient hooks off the parameters (``engine.destroy()``)."""
        self._finalizer()

    def transient_bytes(self, element_size: int) -> int:
        """Bound on the bucket memory alive during backward when buckets are short-lived (stages
        2-3): the buckets in flight, the one filling, and the receive buffer a direct
        reduce-scatter (gloo) keeps per bucket in flight, (N-1)/N of a bucket."""
        biggest = max((b.numel for b in self.buckets), default=0) * element_size
        in_flight = self.max_in_flight if self.max_in_flight is not None else len(self.buckets)
        recv = 0
        if self.scatter and self.world > 1 and direct.enabled(self.dp_group, self.groups[0].params[0]):
            recv = biggest * (self.world - 1) // self.world
        return (in_flight + 1) * biggest + in_flight * recv

    # -- per backward ---------------------------------------------------------------------
    def begin(self, *, active: bool) -> None:
        """Arm (or disarm) reduction for the coming backward pass."""
        self.active = active
        self._launched = 0
        self._arrived: set[tuple[int, int]] = set()  # (group, parameter) whose gradient came this pass
        for b in self.buckets:
            b.pending = len(b.members)
            b.work = None
            b.data = None
        if active and self.buckets:
            self._prepare(self.buckets[0])

    def _prepare(self, bucket: Bucket) -> None:
        """Give ``bucket`` its storage before its first gradient arrives (the stage may then let
        autograd write gradients straight into it)."""
        if bucket.data is None:
            bucket.data = self.store.storage(bucket)

    def _on_grad(self, gi: int, i: int, p: torch.Tensor) -> None:
        """Parameter ``i`` of group ``gi`` has its gradient for this backward (its hook)."""
        if not getattr(p, GRAD_IS_READY, True):  # (param_attrs.grad_is_ready, read without a call per gradient)
            return  # a tiled computation (sequence_parallel.tiled) adds more of this gradient first
        bucket = self._bucket_of[id(p)]
        self.seen.add((gi, i))
        if self.active:
            if (gi, i) in self._arrived:
                for b in self._in_flight:  # (every rank launched the same buckets: finish them, so no
                    if b.work is not None:  # collective of this pass is left open when the error unwinds)
                        b.work.wait()
                        b.work = None
                raise RuntimeError(self._second_gradient_message(gi, i))
            self._arrived.add((gi, i))
        if bucket.data is None:
            bucket.data = self.store.storage(bucket)
        self.store.accept(bucket, i, p)
        if self.active:
            bucket.pending -= 1
            if bucket.pending == 0:
                self._launch_ready()

    def _second_gradient_message(self, gi: int, i: int) -> str:
        names = getattr(self.groups[gi], "names", None)
        name = names[i] if names is not None else f"#{i}"
        return (f"parameter {name!r} received a second gradient in one backward pass: ZeRO had already "
                "counted it as ready, and its bucket may have been reduced without the rest. This "
                "happens when a parameter is used in more than one reentrant activation-checkpointed "
                "region (torch.utils.checkpoint.checkpoint(..., use_reentrant=True), or a model's "
                "gradient_checkpointing with reentrant checkpoints). Use non-reentrant checkpointing "
                "(use_reentrant=False; shardwise.checkpointing.checkpoint is non-reentrant).")

    def _launch_ready(self) -> None:
        while self._launched < len(self.buckets) and self.buckets[self._launched].pending == 0:
            self._launch(self.buckets[self._launched])
            self._launched += 1

    def own_slice(self, bucket: Bucket) -> slice:
        """Where this rank's chunk of the bucket lies inside the bucket's data."""
        _, world, rank = self._comm[bucket.index]
        size = bucket.numel // world
        return slice(rank * size, (rank + 1) * size)

    def _launch(self, b: Bucket) -> None:
        self._prepare(b)  # (no storage yet: no member produced a gradient in this backward)
        if self.before_launch is not None:
            self.before_launch(b)
        r = self.reduce
        data = b.data
        group, world, _ = self._comm[b.index]
        if world == 1:  # (a domain of one rank, e.g. experts at ep_size = data: only the scale applies)
            b.work = None
            self._in_flight.append(b)
            return self._after_launch(b)
        if r.comm_dtype is not None and r.comm_dtype != data.dtype:
            b.comm_buffer = data.to(r.comm_dtype)
            data = b.comm_buffer
        pre = (world if r.prescale else r.predivide_factor) if r.average else r.predivide_factor
        if pre != 1.0:
            data.mul_(1.0 / pre)
        if self.scatter and self.reduce_scatter is not None:
            b.work = self.reduce_scatter(b, data[self.own_slice(b)], data, group)
        elif self.scatter:
            b.work = comm.reduce_scatter_tensor(data[self.own_slice(b)], data, group=group, async_op=True)
        else:
            b.work = comm.all_reduce(data, group=group, async_op=True)
        self._in_flight.append(b)
        self._after_launch(b)

    def _after_launch(self, b: Bucket) -> None:
        if self.max_in_flight is not None:
            while len(self._in_flight) > self.max_in_flight:
                self._complete(self._in_flight.popleft())
        if b.index + 1 < len(self.buckets):  # the next bucket fills next: give it storage now (after
            self._prepare(self.buckets[b.index + 1])  # the completions above returned theirs)

    def _post_scale(self, b: Bucket) -> float:
        r = self.reduce
        world = self._comm[b.index][1]
        if world == 1:
            return self._scale[b.index]
        if r.average and not r.prescale:
            return r.predivide_factor / world * self._scale[b.index]
        if not r.average:
            return r.predivide_factor * self._scale[b.index]
        return self._scale[b.index]

    def _complete(self, b: Bucket) -> None:
        if b.work is not None:
            b.work.wait()
        b.work = None
        region = self.own_slice(b) if self.scatter else slice(None)
        src = (b.comm_buffer if b.comm_buffer is not None else b.data)[region]
        post = self._post_scale(b)
        if post != 1.0:
            src.mul_(post)
        if b.comm_buffer is not None:
            b.data[region].copy_(src)
            b.comm_buffer = None
        self.store.reduced(b, b.data[self.own_slice(b)])
        if self.on_reduced is not None:
            self.on_reduced(b)

    def finish(self) -> None:
        """Launch what autograd left (unused parameters) and wait for every bucket."""
        if not self.active:
            return
        for b in self.buckets[self._launched:]:
            self._launch(b)
        self._launched = len(self.buckets)
        while self._in_flight:
            self._complete(self._in_flight.popleft())
        self.active = False


def _weak_hook(reducer: BucketReducer, gi: int, i: int):
    """The gradient hook of parameter ``i`` of group ``gi``, holding ``reducer`` weakly (a no-op once it is gone)."""
    ref = weakref.ref(reducer)

    def hook(p: torch.Tensor) -> None:
        r = ref()
        if r is not None:
            r._on_grad(gi, i, p)

    return hook


def _remove_all(handles) -> None:
    for h in handles:
        h.remove()
    handles.clear()


# -- the gradient stores of the flat layouts (stages 0, 1, 2) ----------------------------------
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


class PartitionGrads:
    """The step's view of gradients kept only as this rank's partitions (``self.partitions``, one flat tensor
    per group: stage 2 here, stage 3's ``UnitGradients``)."""

    partitions: list[torch.Tensor]

    def owned_grads(self) -> list[torch.Tensor]:
        return list(self.partitions)

    def grad_of(self, f: Fragment) -> torch.Tensor:
        return self.partitions[f.group][f.local : f.local + f.numel]

    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.partitions)


class PooledBucketGradients(PartitionGrads):
    reduce_every_backward = True  # the full gradients do not outlive their bucket
    max_in_flight = 2

    def __init__(self, groups: list[FlatGroup], chunk_local: list[list[int]], world: int, *,
                 accum_dtype: torch.dtype | None = None, keep_pool: bool = False) -> None:
        """``chunk_local[g][k]``: where this rank's chunk of bucket ``k`` of group ``g`` lies in its partition.
        ``accum_dtype``: the partitions' dtype (where micro-steps accumulate) when not the parameters'.
        ``keep_pool``: the (at most two) spare bucket buffers stay for the next backward instead of being
        freed when backward ends (buckets sized by the user: DeepSpeed keeps its reduction buffers too)."""
        self.keep_pool = keep_pool
        self.groups = groups
        self.chunk_local = chunk_local
        self.world = world
        self.partitions = [torch.zeros(g.partition_numel, dtype=accum_dtype or g.dtype, device=g.device)
                           for g in groups]
        self._spare: dict[tuple, list[torch.Tensor]] = {}

    def attach(self) -> None:
        """Nothing: ``param.grad`` are bucket views handed out as buckets are prepared."""

    def backward_finished(self) -> None:
        """Every bucket is reduced: unless kept, the pool lives for one backward and nothing bucket-sized
        outlives it."""
        if not self.keep_pool:
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

    def transient_bytes(self, reducer) -> int:
        return reducer.transient_bytes(self.groups[0].param_buffer.element_size())
