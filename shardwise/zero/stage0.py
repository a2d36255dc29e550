"""ZeRO stage 0: plain data parallelism with bucketed, overlapped all-reduce.

Gradients live in one flat buffer per dtype (``param.grad`` are views of it),
laid out in reverse registration order, which is roughly the order autograd
produces them.  The buffer is cut into buckets of ``reduce_bucket_size``
elements.  A post-accumulate-grad hook counts ready parameters; when a bucket
is complete its asynchronous all-reduce starts at once, so communication
overlaps the rest of backward.  Buckets are always launched in index order
(a bucket waits for its predecessors), which keeps the collective sequence
identical on every rank even if autograd's order differs between them.

With fp16/bf16 the model holds 16-bit weights and gradients; fp32 master
weights (same flat layout) are what the optimizer steps.  The hooks and the
bucketing are ``zero/buckets.py``, shared with stages 1 and 2.
"""

from __future__ import annotations

import torch

from shardwise import comm
from shardwise.precision import PrecisionPolicy, apply_coefficient_, grad_sq_sum
from shardwise.zero import registry
from shardwise.zero.buckets import Bucket, BucketReducer, FlatGradients
from shardwise.zero.flat import FlatGroup, group_by_dtype
from shardwise.zero.layout import ParamLayout
from shardwise.zero.strategy import ReduceSettings, ZeroStrategy


class DataParallelStrategy(ZeroStrategy):
    stage = 0
    replicated = True  # every rank holds the whole optimizer state: rank 0 alone saves it
    norm_is_local = True  # every data rank holds the whole reduced gradients

    def __init__(
        self,
        *,
        named_params: list[tuple[str, torch.nn.Parameter]],
        optimizer: torch.optim.Optimizer,
        precision: PrecisionPolicy,
        dp_group=None,
        reduce: ReduceSettings = ReduceSettings(),
        layout: ParamLayout | None = None,
    ) -> None:
        self.optimizer = optimizer
        self.precision = precision
        self.dp_group = dp_group
        self.dp_world_size = comm.get_world_size(dp_group)
        self.reduce = reduce
        self.layout = layout or ParamLayout(dp_group)
        named_params = self.layout.named(named_params)
        registry.register(self, named_params)
        trainable = [(n, p) for n, p in named_params if p.requires_grad]
        if not trainable:
            raise ValueError("the model has no parameter with requires_grad=True: nothing to train")
        # One set of buffers per reduce domain (the data group; MoE experts: their expert-data group), each
        # in reverse order: the last layers' gradients are ready first.
        self.groups: list[FlatGroup] = []
        for domain, params in self.layout.domains(trainable):
            self.groups += group_by_dtype(list(reversed(params)), bucket_elements=reduce.bucket_elements,
                                          domain=domain)
        # (replicated: an expert domain's sum of squares is summed over the ranks holding the other experts)
        self._norm_groups = [(i, g.domain.norm_group) for i, g in enumerate(self.groups)
                             if g.domain is not None and g.domain.norm_world > 1]
        for g in self.groups:
            g.flatten_params_()
        self._build_masters()  # before any cast, so the masters keep full fp32 values
        for g in self.groups:
            if g.dtype != precision.param_dtype and g.dtype.is_floating_point:
                g.cast_(precision.param_dtype)
        self.gradients = FlatGradients(self.groups, accum_dtype=precision.grad_accum_dtype)
        self.reducer = BucketReducer(self.groups, self.gradients, reduce=reduce, dp_group=dp_group, scatter=False)

    # -- set-up ---------------------------------------------------------------------------
    def _build_masters(self) -> None:
        """fp32 master copies (for 16-bit training) and the optimizer's view of them; none without an
        optimizer (an engine that only runs forward, as DeepSpeed-Chat's reference and reward models)."""
        self.master_buffers = None
        if not self.precision.master_weights or self.optimizer is None:
            self._opt_tensors = [p for g in self.groups for p in g.params]
            return
        self.master_buffers, self.master_params, self._opt_tensors = [], [], []
        swap = {}
        for g in self.groups:
            master = g.param_buffer.to(torch.float32, copy=True)
            self.master_buffers.append(master)
            group_masters = []
            for p, mview in zip(g.params, g.views(master)):
                mp = torch.nn.Parameter(mview, requires_grad=True)
                swap[id(p)] = mp
                group_masters.append(mp)
                self._opt_tensors.append(mp)
            self.master_params.append(group_masters)
        _swap_optimizer_params(self.optimizer, swap)

    # -- backward -------------------------------------------------------------------------
    @property
    def buckets(self) -> list[Bucket]:
        return self.reducer.buckets

    @property
    def grad_buffers(self) -> list[torch.Tensor]:
        return self.gradients.buffers

    def prepare_backward(self, *, boundary: bool, no_sync: bool = False) -> None:
        self.reducer.begin(active=boundary and not no_sync and self._reduce_gradients and self.reducer.needed)
        self.gradients.attach()

    def finish_backward(self) -> None:
        self.reducer.finish()

    # -- step -----------------------------------------------------------------------------
    def _step_grads(self) -> list[torch.Tensor]:
        """The gradients the optimizer steps: the flat buffers themselves, or (16-bit training) fp32
        copies that exist only during the step, attached to the master weights."""
        if self.master_buffers is None:
            if self.precision.grad_accum_dtype is None:
                return self.grad_buffers
            return self._attach_cast_grads()
        out = []
        for group, masters, g in zip(self.groups, self.master_params, self.grad_buffers):
            mg = g.to(torch.float32)
            for mp, view in zip(masters, group.views(mg)):
                mp.grad = view
            out.append(mg)
        return out

    def _attach_cast_grads(self) -> list[torch.Tensor]:
        """Weights in their own dtype, gradients accumulated in another: the step gets cast copies."""
        out = []
        for group, g in zip(self.groups, self.grad_buffers):
            cast = g.to(group.dtype)
            for p, view in zip(group.params, group.views(cast)):
                p.grad = view
            out.append(cast)
        return out

    def _drop_master_grads(self) -> None:
        for masters in getattr(self, "master_params", []):
            for mp in masters:
                mp.grad = None
        if self.master_buffers is None and self.precision.grad_accum_dtype is not None:
            for group in self.groups:
                for p in group.params:
                    p.grad = None

    def local_grad_norm_sq(self, *, counted=None) -> torch.Tensor:
        # Every rank holds the whole (already all-reduced) gradients: every element is reported; an expert
        # domain's other experts are on the other ranks of its expert-parallel group: their sums are added.
        spread = dict(self._norm_groups)

        def tensors(keep) -> list[torch.Tensor]:
            if counted is None:
                return [b for gi, b in enumerate(self.grad_buffers) if keep(gi)]
            return [v for gi, (g, views) in enumerate(zip(self.groups, self.gradients.views)) if keep(gi)
                    for name, v in zip(g.names, views) if counted(name)]

        total = grad_sq_sum(tensors(lambda gi: gi not in spread))
        for gi, group in self._norm_groups:
            sq = grad_sq_sum(tensors(lambda i: i == gi)).to(total.device, torch.float32)
            comm.all_reduce(sq, group=group)
            total = total + sq
        return total

    def apply_step(self, *, coef: float, coef_fixed: bool = False) -> None:
        grads = self._step_grads()
        apply_coefficient_(grads, coef)
        self.optimizer.step()
        self._drop_master_grads()
        if self.master_buffers is not None:
            for g, master in zip(self.groups, self.master_buffers):
                g.param_buffer.copy_(master)

    def zero_grad(self) -> None:
        self.gradients.zero_()

    # -- introspection --------------------------------------------------------------------
    def local_fragments(self):
        """(name, start, end, optimizer tensor) for every parameter: stage 0 holds them all."""
        names = [n for g in self.groups for n in g.names]
        for name, t in zip(names, self._opt_tensors):
            yield name, 0, t.numel(), t

    def memory_parts(self) -> dict[str, int]:
        return {
            "params": sum(g.param_buffer.nbytes for g in self.groups),
            "grads": self.gradients.nbytes(),
            "master_params": sum(t.nbytes for t in self.master_buffers) if self.master_buffers is not None else 0,
            "bucket_buffers": 0,
            "live_params": 0,
            "on_disk": 0,
        }

    def local_grad(self, name: str, start: int, end: int) -> torch.Tensor:
        for gi, g in enumerate(self.groups):
            if name in g.names:
                return self.gradients.views[gi][g.names.index(name)].reshape(-1)[start:end]
        raise KeyError(name)


def _swap_optimizer_params(optimizer: torch.optim.Optimizer, swap: dict[int, torch.Tensor]) -> None:
    """Point the optimizer's param groups at the fp32 master copies."""
    if optimizer.state:
        raise ValueError(
            "the optimizer already has state; pass a freshly constructed optimizer to initialize() "
            "when fp16/bf16 is enabled (its parameters are replaced by fp32 master weights)"
        )
    for group in optimizer.param_groups:
        group["params"] = [swap.get(id(p), p) for p in group["params"]]
