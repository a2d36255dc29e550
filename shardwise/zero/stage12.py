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
each bucket gets a short-lived buffer (from a small pool) whose views become
the members' ``param.grad``, so autograd accumulates straight into it; it is
reduce-scattered as soon as the bucket is complete, this rank's chunk is added
into a partition-sized gradient buffer and ``param.grad`` is released.
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
        offload_optimizer=None,
        sub_group_size: int = 1_000_000_000,
        aio=None,
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
        self.offload_device = _offload_device(offload_optimizer)
        self._build_partitions()  # fp32 masters from the fp32 weights, before the cast
        self._setup_offload(offload_optimizer, sub_group_size, aio)
        for g in self.groups:
            if g.dtype != precision.param_dtype and g.dtype.is_floating_point:
                g.cast_(precision.param_dtype)
        self._build_grads()
        self._spare_buckets: dict[tuple, list[torch.Tensor]] = {}
        self.reducer = BucketReducer(
            self.groups, reduce=reduce, dp_group=dp_group,
            scatter=use_reduce_scatter,
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
        self.master_buffers: list[torch.Tensor] | None = [] if self._wants_master() else None
        self.fragments: list[list[_Fragment]] = []
        replace: dict[int, list[torch.Tensor]] = {}
        for gi, g in enumerate(self.groups):
            if self.master_buffers is not None:
                master = torch.cat([g.param_buffer[a:b] for a, b in self.chunks[gi]])
                self.master_buffers.append(master.to(device=self._master_device(g.device), dtype=torch.float32,
                                                     copy=True))
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

    def _wants_master(self) -> bool:
        """A separate fp32 copy in memory: 16-bit training, or the optimizer offloaded to the CPU.
        (NVMe offload keeps its copy in files; see ``_setup_offload``.)"""
        return self.offload_device != "nvme" and (self.precision.master_weights or self.offload_device == "cpu")

    def _master_device(self, device: torch.device) -> torch.device:
        return torch.device("cpu") if self.offload_device == "cpu" else device

    def _setup_offload(self, offload, sub_group_size: int, aio) -> None:
        """NVMe: move the fp32 weights (and, once created, the optimizer states) into files."""
        self.swapper = None
        if self.offload_device != "nvme":
            return
        from shardwise.zero.offload import NvmeStore, OptimizerSwapper

        store = NvmeStore(offload.nvme_path, rank=comm.get_rank(),
                          threads=aio.thread_count if aio is not None else 1,
                          block_size=aio.block_size if aio is not None else 1 << 20,
                          queue_depth=aio.queue_depth if aio is not None else 8)
        self.swapper = OptimizerSwapper(store, self.optimizer, [f for fr in self.fragments for f in fr],
                                        sub_group_size=sub_group_size, buffer_count=offload.buffer_count,
                                        initial_value=lambda f: f.tensor.detach())

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
        free = self._spare_buckets.get((b.numel, g.dtype))
        # Reuse a buffer a finished bucket gave back (stage 2 needs fresh bucket storage every backward).
        data = free.pop().zero_() if free else torch.zeros(b.numel, dtype=g.dtype, device=g.device)
        # Members whose gradient is still to come get ``param.grad`` as a view of the bucket: autograd
        # then accumulates into it in place, and the gradient needs no copy.
        for i in b.members:
            p = g.params[i]
            if p.grad is None:
                off = g.offsets[i] - b.start
                p.grad = data[off : off + g.numels[i]].view_as(p)
        return data

    def _accept_grad(self, b: Bucket, i: int, p: torch.Tensor) -> None:
        g = self.groups[b.group_index]
        if self.stage == 1:
            view = self.grad_views[b.group_index][i]
            if p.grad is not view:
                view.copy_(p.grad)
                p.grad = view
            return
        off = g.offsets[i] - b.start
        view = b.data[off : off + g.numels[i]]
        if p.grad.data_ptr() != view.data_ptr():  # arrived before its bucket had storage: copy it in
            view.copy_(p.grad.reshape(-1))
            p.grad = view.view_as(p)

    def _bucket_done(self, b: Bucket) -> None:
        if self.stage == 2:
            local = self.chunk_local[b.group_index][self._chunk_pos[b.index]]
            size = b.numel // self.world
            self.partition_grads[b.group_index][local : local + size].add_(b.data[self.reducer.own_slice(b)])
            g = self.groups[b.group_index]
            for i in b.members:  # the full gradient does not outlive its bucket
                g.params[i].grad = None
            spare = self._spare_buckets.setdefault((b.numel, b.data.dtype), [])
            if len(spare) < 2:
                spare.append(b.data)
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

    def _grad_source(self, f: _Fragment) -> torch.Tensor:
        """This rank's reduced gradient (model dtype) of fragment ``f``."""
        if self.stage == 1:
            return self.grad_buffers[f.group][f.buffer_start : f.buffer_start + f.numel]
        return self.partition_grads[f.group][f.local : f.local + f.numel]

    def _weight_target(self, f: _Fragment) -> torch.Tensor:
        """Where the model's own (possibly 16-bit) weights of fragment ``f`` live."""
        return self.groups[f.group].param_buffer[f.buffer_start : f.buffer_start + f.numel]

    @property
    def _separate_master(self) -> bool:
        """True when the optimizer steps a copy of the weights (fp32 master, or offloaded)."""
        return self.master_buffers is not None or self.swapper is not None

    def _fragment_batches(self):
        """Lists of fragments whose weights and optimizer states are resident (all of them at once,
        unless the optimizer is offloaded to NVMe: then one sub-group after another)."""
        if self.swapper is not None:
            yield from self.swapper.batches()
        else:
            yield [f for frags in self.fragments for f in frags]

    def step(self, *, loss_scale: float, clip: float) -> StepResult:
        sq = None
        for gi in range(len(self.groups)):
            for t in self._own_grad_chunks(gi):
                part = _sq_sum(t)
                sq = part if sq is None else sq + part
        if self.world > 1:
            comm.all_reduce(sq, group=self.dp_group)
        total = sq.sqrt() / loss_scale
        if self.precision.check_overflow and not bool(torch.isfinite(total)):
            return StepResult(grad_norm=float("inf"), overflow=True)
        norm = float(total)
        coef = 1.0 / loss_scale
        if clip > 0 and clip / (norm + 1e-6) < 1.0:
            coef *= clip / (norm + 1e-6)
        for frags in self._fragment_batches():
            grads = [self._grad_source(f) for f in frags]
            if self._separate_master or grads and grads[0].dtype != torch.float32:
                grads = [g.to(device=f.tensor.device, dtype=torch.float32, copy=True) for g, f in zip(grads, frags)]
            if coef != 1.0 and grads:
                torch._foreach_mul_(grads, coef)
            for f, g in zip(frags, grads):
                f.tensor.grad = g.view_as(f.tensor)
            self._step_subset(frags)
            for f in frags:
                f.tensor.grad = None
            if self._separate_master:
                self._write_back(frags)
        self._after_step()
        return StepResult(grad_norm=norm, overflow=False)

    def _write_back(self, frags: list[_Fragment]) -> None:
        """Copy the updated fp32 weights into the model's own (possibly 16-bit) weights."""
        for f in frags:
            self._weight_target(f).copy_(f.tensor.detach().reshape(-1))

    def _step_subset(self, frags: list[_Fragment]) -> None:
        """``optimizer.step()`` on just these fragments (all of them: a plain step)."""
        if self.swapper is None:
            self.optimizer.step()
            return
        wanted = {id(f.tensor) for f in frags}
        saved = [g["params"] for g in self.optimizer.param_groups]
        try:
            for g in self.optimizer.param_groups:
                g["params"] = [t for t in g["params"] if id(t) in wanted]
            self.optimizer.step()
        finally:
            for g, params in zip(self.optimizer.param_groups, saved):
                g["params"] = params

    def _after_step(self) -> None:
        """All-gather every bucket in place: each rank contributes the chunks it just updated."""
        if self.world == 1:
            return
        pending, in_flight = [], 0
        for gi, g in enumerate(self.groups):
            for (a, b), (bs, be) in zip(self.chunks[gi], g.buckets):
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
        bucket = self.reducer.transient_bytes(self.groups[0].param_buffer.element_size()) if self.stage == 2 else 0
        return {
            "params": sum(g.param_buffer.nbytes for g in self.groups),
            "grads": sum(t.nbytes for t in grads),
            "master_params": sum(t.nbytes for t in self.master_buffers) if self.master_buffers is not None else 0,
            "bucket_buffers": bucket,
            "live_params": 0,
            "on_disk": self.swapper.store.disk_bytes() if self.swapper is not None else 0,
        }

    def local_grad(self, name: str, start: int, end: int) -> torch.Tensor:
        for gi, frags in enumerate(self.fragments):
            for f in frags:
                if f.name == name and f.param_start == start:
                    if self.stage == 1:
                        return self.grad_buffers[gi][f.buffer_start : f.buffer_start + f.numel]
                    return self.partition_grads[gi][f.local : f.local + f.numel]
        raise KeyError(f"{name}[{start}:{end}] is not owned by this rank")

    def fragment_batches(self):
        for frags in self._fragment_batches():
            yield [(f.name, f.param_start, f.param_end, f.tensor) for f in frags]

    def local_fragments(self):
        """(name, param_start, param_end, optimizer tensor = fp32 weights) for every owned fragment."""
        for frags in self.fragments:
            for f in frags:
                yield f.name, f.param_start, f.param_end, f.tensor


def _offload_device(block) -> str:
    return getattr(block, "device", "none") if block is not None else "none"


def _sq_sum(t: torch.Tensor, piece: int = 1 << 24) -> torch.Tensor:
    """Sum of squares in fp32, a slice at a time (no full-size fp32 copy of a 16-bit tensor)."""
    flat = t.reshape(-1)
    total = torch.zeros((), dtype=torch.float32, device=t.device)
    for i in range(0, flat.numel(), piece):
        total += flat[i : i + piece].float().pow(2).sum()
    return total


def _local_offsets(chunks: list[tuple[int, int]]) -> list[int]:
    out, pos = [], 0
    for a, b in chunks:
        out.append(pos)
        pos += b - a
    return out
