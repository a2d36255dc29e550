"""ZeRO stages 1 and 2: partitioned optimizer states (1) and gradients (2).

Layout: trainable parameters in one flat buffer per dtype, cut into buckets,
each bucket padded to a multiple of the data-parallel size N.  Rank r owns
the r-th chunk of every bucket: its fp32 master weights, its optimizer state
and (stage 2) its gradients exist only for those chunks.  The optimizer steps
one 1-D view per (parameter, owned range) — a "fragment" — so param groups
keep their own hyper-parameters and checkpoints can name every piece.

Stage 1 keeps a full local gradient buffer (accumulation is local and free);
at the boundary every bucket is reduce-scattered in place as soon as its
gradients are ready.  Stage 2 never holds full gradients: every micro-step
each bucket's gradients are copied into a short-lived bucket buffer,
reduce-scattered as soon as the bucket is complete, and this rank's chunk is
added into a partition-sized gradient buffer; ``param.grad`` is freed.
After the optimizer step, updated chunks are all-gathered in place.
"""

from __future__ import annotations

import torch

from shardwise import comm
from shardwise.precision import PrecisionPolicy
from shardwise.zero.buckets import Bucket, BucketReducer
from shardwise.zero.flat import FlatGroup, group_by_dtype
from shardwise.zero.strategy import ReduceSettings, StepResult, ZeroStrategy


class _Fragment:
    """One optimizer tensor: ``name[param_start:param_end]`` held at ``local`` of the partition."""

    __slots__ = ("name", "group", "param_start", "param_end", "buffer_start", "local", "tensor")

    def __init__(self, name, group, param_start, param_end, buffer_start, local, tensor) -> None:
        self.name, self.group = name, group
        self.param_start, self.param_end = param_start, param_end
        self.buffer_start, self.local, self.tensor = buffer_start, local, tensor

    @property
    def numel(self) -> int:
        return self.param_end - self.param_start


class PartitionedStrategy(ZeroStrategy):
    def __init__(
        self,
        *,
        stage: int,
        named_params: list[tuple[str, torch.nn.Parameter]],
        optimizer: torch.optim.Optimizer,
        precision: PrecisionPolicy,
        dp_group=None,
        reduce: ReduceSettings = ReduceSettings(),
        allgather_bucket_elements: int = 500_000_000,
        use_reduce_scatter: bool = True,
    ) -> None:
        assert stage in (1, 2)
        self.stage = stage
        self.optimizer = optimizer
        self.precision = precision
        self.dp_group = dp_group
        self.world = comm.get_world_size(dp_group)
        self.rank = comm.get_rank(dp_group)
        self.allgather_bucket_elements = allgather_bucket_elements
        trainable = [(n, p) for n, p in named_params if p.requires_grad]
        if not trainable:
            raise ValueError("the model has no parameter with requires_grad=True: nothing to train")
        self.groups: list[FlatGroup] = group_by_dtype(list(reversed(trainable)), world_size=self.world,
                                                      bucket_elements=reduce.bucket_elements)
        self.chunks = [g.rank_chunks(self.rank) for g in self.groups]
        self.chunk_local = [_local_offsets(ch) for ch in self.chunks]
        for g in self.groups:
            g.flatten_params_()
        self._build_partitions()  # fp32 masters from the fp32 weights, before the cast
        for g in self.groups:
            if g.dtype != precision.param_dtype and g.dtype.is_floating_point:
                g.cast_(precision.param_dtype)
        self._build_grads()
        self.reducer = BucketReducer(
            self.groups, reduce=reduce, dp_group=dp_group, scatter=use_reduce_scatter,
            storage=self._bucket_storage, accept=self._accept_grad, done=self._bucket_done,
            max_in_flight=2 if stage == 2 else None,
        )
        first = {}
        for b in self.reducer.buckets:
            first.setdefault(b.group_index, b.index)
        self._chunk_pos = {b.index: b.index - first[b.group_index] for b in self.reducer.buckets}

    # -- set-up ---------------------------------------------------------------------------
    def _build_partitions(self) -> None:
        """This rank's fp32 weights (a copy for 16-bit training, views otherwise) as fragments."""
        self.master_buffers: list[torch.Tensor] | None = [] if self.precision.master_weights else None
        self.fragments: list[list[_Fragment]] = []
        replace: dict[int, list[torch.Tensor]] = {}
        for gi, g in enumerate(self.groups):
            if self.master_buffers is not None:
                master = torch.cat([g.param_buffer[a:b] for a, b in self.chunks[gi]]).to(torch.float32)
                self.master_buffers.append(master)
            frags = []
            for (a, b), local0 in zip(self.chunks[gi], self.chunk_local[gi]):
                for f in g.fragments(a, b):
                    local = local0 + f.buffer_start - a
                    if self.master_buffers is not None:
                        view = self.master_buffers[gi][local : local + f.buffer_end - f.buffer_start]
                    else:
                        view = g.param_buffer[f.buffer_start : f.buffer_end]
                    t = torch.nn.Parameter(view, requires_grad=True)
                    frag = _Fragment(g.names[f.index], gi, f.param_start, f.param_end, f.buffer_start, local, t)
                    frags.append(frag)
                    replace.setdefault(id(g.params[f.index]), []).append(t)
            self.fragments.append(frags)
        if self.optimizer is not None:
            if self.optimizer.state:
                raise ValueError("the optimizer already has state; pass a freshly constructed optimizer to "
                                 "initialize() (ZeRO replaces its parameters by this rank's partition)")
            laid_out = {id(p) for g in self.groups for p in g.params}
            for group in self.optimizer.param_groups:  # a parameter owned elsewhere is dropped here
                group["params"] = [t for p in group["params"]
                                   for t in (replace.get(id(p), []) if id(p) in laid_out else [p])]

    def _build_grads(self) -> None:
        if self.stage == 1:  # full local gradient buffer; param.grad are views of it
            self.grad_buffers = [g.new_buffer() for g in self.groups]
            self.grad_views = [g.views(buf) for g, buf in zip(self.groups, self.grad_buffers)]
            self._attach_grads()
        else:  # only this rank's chunks, accumulated across micro-steps
            self.partition_grads = [torch.zeros(g.partition_numel, dtype=g.dtype, device=g.device)
                                    for g in self.groups]

    def _attach_grads(self) -> None:
        for g, views in zip(self.groups, self.grad_views):
            for p, v in zip(g.params, views):
                p.grad = v

    # -- backward -------------------------------------------------------------------------
    def _bucket_storage(self, b: Bucket) -> torch.Tensor:
        if self.stage == 1:
            return self.grad_buffers[b.group_index][b.start : b.end]
        g = self.groups[b.group_index]
        return torch.zeros(b.numel, dtype=g.dtype, device=g.device)

    def _accept_grad(self, b: Bucket, i: int, p: torch.Tensor) -> None:
        g = self.groups[b.group_index]
        if self.stage == 1:
            view = self.grad_views[b.group_index][i]
            if p.grad is not view:
                view.copy_(p.grad)
                p.grad = view
            return
        off = g.offsets[i] - b.start
        b.data[off : off + g.numels[i]].copy_(p.grad.reshape(-1))
        p.grad = None  # stage 2: the full gradient does not outlive its bucket

    def _bucket_done(self, b: Bucket) -> None:
        if self.stage == 2:
            local = self.chunk_local[b.group_index][self._chunk_pos[b.index]]
            size = b.numel // self.world
            self.partition_grads[b.group_index][local : local + size].add_(b.data[self.reducer.own_slice(b)])
            b.data = None

    @property
    def buckets(self) -> list[Bucket]:
        return self.reducer.buckets

    def prepare_backward(self, *, boundary: bool, no_sync: bool = False) -> None:
        if self.stage == 2 and no_sync:
            raise ValueError("zero_optimization.stage 2 reduces gradients on every backward; "
                             "engine.no_sync() is not supported with it (use stage 0 or 1)")
        # Stage 1 accumulates locally and reduces at the boundary; stage 2 reduces every backward.
        self.reducer.begin(active=self.stage == 2 or (boundary and not no_sync and self.world > 1))
        if self.stage == 1:
            self._attach_grads()

    def finish_backward(self) -> None:
        self.reducer.finish()

    # -- step -----------------------------------------------------------------------------
    def _own_grad_chunks(self, gi: int) -> list[torch.Tensor]:
        """This rank's reduced gradients of group ``gi``, one tensor per bucket chunk."""
        if self.stage == 1:
            return [self.grad_buffers[gi][a:b] for a, b in self.chunks[gi]]
        return [self.partition_grads[gi]]

    def _fp32_grads(self, loss_scale: float) -> list[torch.Tensor]:
        """fp32 gradients of this rank's partition, unscaled, attached to the fragments."""
        out = []
        for gi, g in enumerate(self.groups):
            chunks = self._own_grad_chunks(gi)
            if self.master_buffers is None and self.stage == 1:
                grads = chunks  # fp32 already, in place
                for f in self.fragments[gi]:
                    f.tensor.grad = self.grad_buffers[gi][f.buffer_start : f.buffer_start + f.numel]
            else:
                flat = torch.cat(chunks) if len(chunks) > 1 else chunks[0]
                grads = [flat.to(torch.float32) if flat.dtype != torch.float32 else flat]
                for f in self.fragments[gi]:
                    f.tensor.grad = grads[0][f.local : f.local + f.numel]
            if loss_scale != 1.0:
                for t in grads:
                    t.mul_(1.0 / loss_scale)
            out.extend(grads)
        return out

    def step(self, *, loss_scale: float, clip: float) -> StepResult:
        grads = self._fp32_grads(loss_scale)
        sq = torch.zeros((), dtype=torch.float32, device=grads[0].device)
        for t in grads:
            sq += t.pow(2).sum()
        if self.world > 1:
            comm.all_reduce(sq, group=self.dp_group)
        total = sq.sqrt()
        finite = bool(torch.isfinite(total))
        if self.precision.check_overflow and not finite:
            self._drop_fragment_grads()
            return StepResult(grad_norm=float("inf"), overflow=True)
        norm = float(total)
        if clip > 0:
            coef = clip / (norm + 1e-6)
            if coef < 1.0:
                for t in grads:
                    t.mul_(coef)
        self.optimizer.step()
        self._drop_fragment_grads()
        self._publish_params()
        return StepResult(grad_norm=norm, overflow=False)

    def _drop_fragment_grads(self) -> None:
        for frags in self.fragments:
            for f in frags:
                f.tensor.grad = None

    def _publish_params(self) -> None:
        """Write updated chunks into the 16-bit buffer (if any) and all-gather every bucket in place."""
        pending, in_flight = [], 0
        for gi, g in enumerate(self.groups):
            for (a, b), local, (bs, be) in zip(self.chunks[gi], self.chunk_local[gi], g.buckets):
                if self.master_buffers is not None:
                    g.param_buffer[a:b].copy_(self.master_buffers[gi][local : local + b - a])
                if self.world == 1:
                    continue
                pending.append(comm.all_gather_into_tensor(g.param_buffer[bs:be], g.param_buffer[a:b],
                                                           group=self.dp_group, async_op=True))
                in_flight += be - bs
                if in_flight >= self.allgather_bucket_elements:
                    for w in pending:
                        w.wait()
                    pending, in_flight = [], 0
        for w in pending:
            w.wait()

    def zero_grad(self) -> None:
        if self.stage == 1:
            for buf in self.grad_buffers:
                buf.zero_()
            self._attach_grads()
        else:
            for buf in self.partition_grads:
                buf.zero_()
            for g in self.groups:
                for p in g.params:
                    p.grad = None

    # -- introspection --------------------------------------------------------------------
    replicated = False

    def memory_parts(self) -> dict[str, int]:
        grads = self.partition_grads if self.stage == 2 else self.grad_buffers
        bucket = 2 * max(b.numel for b in self.buckets) * self.groups[0].param_buffer.element_size() \
            if self.stage == 2 else 0
        return {
            "params": sum(g.param_buffer.nbytes for g in self.groups),
            "grads": sum(t.nbytes for t in grads),
            "master_params": sum(t.nbytes for t in self.master_buffers) if self.master_buffers is not None else 0,
            "bucket_buffers": bucket,
            "live_params": 0,
        }

    def local_grad(self, name: str, start: int, end: int) -> torch.Tensor:
        for gi, frags in enumerate(self.fragments):
            for f in frags:
                if f.name == name and f.param_start == start:
                    if self.stage == 1:
                        return self.grad_buffers[gi][f.buffer_start : f.buffer_start + f.numel]
                    return self.partition_grads[gi][f.local : f.local + f.numel]
        raise KeyError(f"{name}[{start}:{end}] is not owned by this rank")

    def local_fragments(self):
        """(name, param_start, param_end, optimizer tensor = fp32 weights) for every owned fragment."""
        for frags in self.fragments:
            for f in frags:
                yield f.name, f.param_start, f.param_end, f.tensor


def _local_offsets(chunks: list[tuple[int, int]]) -> list[int]:
    out, pos = [], 0
    for a, b in chunks:
        out.append(pos)
        pos += b - a
    return out
