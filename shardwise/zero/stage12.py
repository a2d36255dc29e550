"""ZeRO stages 1 and 2: partitioned optimizer states (1) and gradients (2).

Layout: trainable parameters in one flat buffer per dtype, cut into buckets,
each bucket padded to a multiple of the data-parallel size N.  Rank r owns
the r-th chunk of every bucket: its fp32 master weights, its optimizer state
and (stage 2) its gradients exist only for those chunks.  The optimizer step
on those chunks is ``PartitionedOptimizer`` (``partitioned_step.py``, shared
with stage 3).

The two stages differ only in where gradients live, which is the injected
gradient store (``buckets.py``): stage 1 a full local buffer reduced at the
boundary (``FlatGradients``), stage 2 pooled bucket buffers reduced every
backward into a partition-sized buffer (``PooledBucketGradients``).
After the optimizer step, updated chunks are all-gathered in place.
"""

from __future__ import annotations

import torch

from shardwise import comm
from shardwise.precision import PrecisionPolicy
from shardwise.zero import registry
from shardwise.zero.buckets import Bucket, BucketReducer, FlatGradients, PooledBucketGradients
from shardwise.zero.flat import FlatGroup, group_by_dtype
from shardwise.zero.layout import ParamLayout
from shardwise.zero.partitioned_step import FlatSource, Fragment, PartitionedOptimizer, offload_device
from shardwise.zero.strategy import ReduceSettings, ZeroStrategy


class PartitionedStrategy(ZeroStrategy):
    """Stages 1-2; subclasses choose the gradient store (``_gradient_store``)."""

    replicated = False
    norm_is_local = False  # each data rank holds a disjoint share of the norm

    def __init__(
        self,
        *,
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
        ignore_unused_parameters: bool = True,
        layout: ParamLayout | None = None,
    ) -> None:
        self.optimizer = optimizer
        self.reduce = reduce
        self.ignore_unused_parameters = ignore_unused_parameters
        self.precision = precision
        self.dp_group = dp_group
        self.world = self.dp_world_size = comm.get_world_size(dp_group)
        self.rank = comm.get_rank(dp_group)
        self.allgather_bucket_elements = allgather_bucket_elements
        self.layout = layout or ParamLayout(dp_group)
        named_params = self.layout.named(named_params)
        registry.register(self, named_params)
        trainable = [(n, p) for n, p in named_params if p.requires_grad]
        if not trainable:
            raise ValueError("the model has no parameter with requires_grad=True: nothing to train")
        # One set of buffers per reduce domain (the data group; MoE experts: their expert-data group), each
        # padded for and partitioned over its own group.
        self.groups: list[FlatGroup] = []
        for domain, params in self.layout.domains(trainable):
            if params:
                self.groups += group_by_dtype(list(reversed(params)), world_size=domain.world, domain=domain,
                                              bucket_elements=self._bucket_elements(reduce, params))
        self.chunks = [g.rank_chunks(g.domain.rank) for g in self.groups]
        self.chunk_local = [_local_offsets(ch) for ch in self.chunks]
        for g in self.groups:
            g.flatten_params_()
        source = FlatSource(self.groups)  # where the step finds gradients (given below) and weights
        self.partition = PartitionedOptimizer(  # fp32 masters from the fp32 weights, before the cast
            optimizer, source=source, partition_of=self._partition_of, fragments=self._fragments(),
            params_of={n: p for g in self.groups for n, p in zip(g.names, g.params)},
            laid_out={id(p) for g in self.groups for p in g.params},
            separate_master=precision.master_weights, offload=offload_optimizer,
            sub_group_size=sub_group_size, aio=aio, dp_group=dp_group)
        self.offload_device = offload_device(offload_optimizer)
        for g in self.groups:
            if g.dtype != precision.param_dtype and g.dtype.is_floating_point:
                g.cast_(precision.param_dtype)
        self.gradients = source.gradients = self._gradient_store()
        # The fragments whose gradients a bucket's reduction makes final (for the overlapped offload step):
        # only an offloaded step overlaps backward, so only it hears of each reduced bucket.
        self.partition.bucket_fragments = [[f for f in self.fragments[gi] if a <= f.buffer_start < b]
                                           for gi in range(len(self.groups)) for (a, b) in self.chunks[gi]]
        self.reducer = BucketReducer(self.groups, self.gradients, reduce=reduce, dp_group=dp_group,
                                     scatter=use_reduce_scatter,
                                     on_reduced=self.partition.bucket_reduced if self.partition.overlap_step else None)

    def _gradient_store(self):
        raise NotImplementedError

    def _bucket_elements(self, reduce: ReduceSettings, trainable) -> int:
        return reduce.bucket_elements

    # -- set-up ---------------------------------------------------------------------------
    def _fragments(self) -> list[list[Fragment]]:
        out = []
        for gi, g in enumerate(self.groups):
            frags = []
            for (a, b), local0 in zip(self.chunks[gi], self.chunk_local[gi]):
                for f in g.fragments(a, b):
                    frags.append(Fragment(g.names[f.index], gi, f.param_start, f.param_end, f.buffer_start,
                                          local0 + f.buffer_start - a))
            out.append(frags)
        return out

    def _partition_of(self, gi: int) -> torch.Tensor:
        g = self.groups[gi]
        return torch.cat([g.param_buffer[a:b] for a, b in self.chunks[gi]])

    def owned_grads(self) -> list[torch.Tensor]:
        """This rank's reduced (still scaled) gradients."""
        return self.gradients.owned_grads()

    def weight_of(self, f: Fragment) -> torch.Tensor:
        """Where the model's weights of fragment ``f`` live, 1-D."""
        return self.partition.source.weight_of(f)

    # -- backward -------------------------------------------------------------------------
    @property
    def buckets(self) -> list[Bucket]:
        return self.reducer.buckets

    def prepare_backward(self, *, boundary: bool, no_sync: bool = False) -> None:
        if no_sync and self.gradients.reduce_every_backward:
            raise ValueError(f"zero_optimization.stage {self.stage} reduces gradients on every backward; "
                             "engine.no_sync() is not supported with it (use stage 0 or 1)")
        self.reducer.begin(active=self.gradients.reduce_every_backward  # (_reduce_gradients: reduce_gradients' value)
                           or (boundary and not no_sync and self.reducer.needed and self._reduce_gradients))
        self.gradients.attach()
        if boundary and not no_sync:
            self.partition.arm()

    def finish_backward(self) -> None:
        self.reducer.finish()
        self.gradients.backward_finished()
        self.partition.backward_finished()

    # -- step -----------------------------------------------------------------------------
    def local_grad_norm_sq(self, *, counted=None) -> torch.Tensor:
        if not self.ignore_unused_parameters:
            self._check_all_used()
        return self.partition.grad_norm_sq(counted=counted)

    def _check_all_used(self) -> None:
        """``ignore_unused_parameters: false``: at the step, every trainable parameter must have had a
        gradient since the last step, on every rank; the ranks agree before raising (none is left waiting)."""
        missing = [g.names[i] for gi, g in enumerate(self.groups) for i in range(len(g.params))
                   if (gi, i) not in self.reducer.seen]
        count = torch.tensor([float(len(missing))])
        if self.world > 1:
            comm.all_reduce(count, group=self.dp_group)
        if count.item() > 0:
            where = f"parameters {missing[:5]}{' ...' if len(missing) > 5 else ''} got" if missing else \
                "on another data-parallel rank, parameters got"
            raise UnusedParametersError(
                f"zero_optimization.ignore_unused_parameters is false, and {where} no gradient since the last step: "
                "make every trainable parameter take part in the loss (or freeze it), or set "
                "ignore_unused_parameters: true (the default) to train with parameters that get no gradient")

    def apply_step(self, *, coef: float, coef_fixed: bool = False) -> None:
        self.partition.apply_step(coef=coef, coef_fixed=coef_fixed)
        self._all_gather_params()

    def _all_gather_params(self) -> None:
        """All-gather every bucket in place over its domain: each rank contributes the chunks it just updated."""
        pending, in_flight = [], 0
        for gi, g in enumerate(self.groups):
            if g.domain.world == 1:
                continue
            for (a, b), (bs, be) in zip(self.chunks[gi], g.buckets):
                pending.append(comm.all_gather_into_tensor(g.param_buffer[bs:be], g.param_buffer[a:b],
                                                           group=g.domain.group, async_op=True))
                in_flight += be - bs
                if in_flight >= self.allgather_bucket_elements:
                    for w in pending:
                        w.wait()
                    pending, in_flight = [], 0
        for w in pending:
            w.wait()

    def zero_grad(self) -> None:
        self.gradients.zero_()
        self.reducer.seen.clear()

    # -- introspection --------------------------------------------------------------------
    @property
    def swapper(self):
        return self.partition.swapper

    @property
    def fragments(self) -> list[list[Fragment]]:
        return self.partition.fragments

    def memory_parts(self) -> dict[str, int]:
        return {
            "params": sum(g.param_buffer.nbytes for g in self.groups),
            "grads": self.gradients.nbytes(),
            "master_params": self.partition.master_bytes(),
            "bucket_buffers": self.gradients.transient_bytes(self.reducer),
            "live_params": 0,
            "on_disk": self.partition.disk_bytes(),
        }

    def local_grad(self, name: str, start: int, end: int) -> torch.Tensor:
        return self.gradients.grad_of(self.partition.fragment_at(name, start, end))

    def fragment_batches(self):
        return self.partition.fragment_batches()

    def local_fragments(self):
        return self.partition.local_fragments()


class UnusedParametersError(ValueError, AssertionError):
    """A trainable parameter got no gradient with ``ignore_unused_parameters: false``: a ValueError (a
    model/config mismatch) that is also the AssertionError DeepSpeed raises here."""


class Stage1Strategy(PartitionedStrategy):
    """Partitioned optimizer state; full local gradients, reduce-scattered at the boundary."""

    stage = 1

    def _gradient_store(self) -> FlatGradients:
        return FlatGradients(self.groups, self.chunks, accum_dtype=self.precision.grad_accum_dtype)


class Stage2Strategy(PartitionedStrategy):
    """Partitioned optimizer state and gradients; buckets reduce-scattered every backward."""

    stage = 2
    shards_gradients = True
    min_buckets = 64  # the whole gradients are cut into at least this many short-lived buckets ...
    min_bucket_elements = 1 << 18  # ... of at least this many elements (fewer, larger collectives)

    def _gradient_store(self) -> PooledBucketGradients:
        return PooledBucketGradients(self.groups, self.chunk_local, self.world,
                                     accum_dtype=self.precision.grad_accum_dtype,
                                     keep_pool=self.reduce.bucket_size_given)

    def _bucket_elements(self, reduce: ReduceSettings, trainable) -> int:
        """At stage 2 a bucket is a short-lived full-size copy of its gradients, alive until reduced.

        A ``reduce_bucket_size`` the config gives is used as given, as DeepSpeed does (the user chose
        fewer, larger collectives over memory; with a size of the whole model stage 2 holds what stage 1
        does). Left at its default (5e8 elements, more than most models: one bucket would be a whole
        gradient buffer), buckets are cut to 1/64 of the model (at least 2^18 elements), so the few alive
        at once stay a few percent of the model states."""
        if reduce.bucket_size_given:
            return reduce.bucket_elements
        total = sum(p.numel() for _, p in trainable)
        return min(reduce.bucket_elements, max(self.min_bucket_elements, -(-total // self.min_buckets)))


def _local_offsets(chunks: list[tuple[int, int]]) -> list[int]:
    out, pos = [], 0
    for a, b in chunks:
        out.append(pos)
        pos += b - a
    return out
