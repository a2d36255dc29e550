"""The optimizer step on this rank's partition, shared by ZeRO stages 1, 2 and 3.

A rank owns pieces of parameters ("fragments": ``name[param_start:param_end]``).
The optimizer steps one 1-D fp32 tensor per fragment, so param groups keep their
own hyper-parameters and checkpoints can name every piece.  That tensor is a view
of the model's own weights (fp32 training), or of a separate fp32 copy (16-bit
training, CPU offload), or lives in a file between steps (NVMe offload, where
``OptimizerSwapper`` swaps sub-groups in one after the other).

The strategies compose a ``PartitionedOptimizer`` and hand it, at step time, the
place of each fragment's reduced gradient and of its model weights
(``FragmentSource``).  ``step_batch`` steps one resident list of fragments: a
later "step sub-group k as soon as its gradients are reduced" calls it per
sub-group instead of once after backward.
"""

from __future__ import annotations

from typing import Protocol

import torch

from shardwise import comm
from shardwise.precision import StepResult, apply_coefficient_, grad_sq_sum, unscale_and_clip


class Fragment:
    """One optimizer tensor: ``name[param_start:param_end]``; ``group`` is the index of the flat group
    (stages 1-2) or unit (stage 3), ``buffer_start`` the offset in that group's flat buffer and
    ``local`` the offset in this rank's partition of it."""

    __slots__ = ("name", "group", "param_start", "param_end", "buffer_start", "local", "tensor")

    def __init__(self, name, group, param_start, param_end, buffer_start, local, tensor=None) -> None:
        self.name, self.group = name, group
        self.param_start, self.param_end = param_start, param_end
        self.buffer_start, self.local, self.tensor = buffer_start, local, tensor

    @property
    def numel(self) -> int:
        return self.param_end - self.param_start


class FragmentSource(Protocol):
    """What a strategy tells the partitioned step about its layout."""

    def owned_grads(self) -> list[torch.Tensor]:
        """This rank's reduced (still scaled) gradients, for the global norm."""

    def grad_of(self, f: Fragment) -> torch.Tensor:
        """This rank's reduced gradient (model dtype) of fragment ``f``, 1-D."""

    def weight_of(self, f: Fragment) -> torch.Tensor:
        """Where the model's own weights of fragment ``f`` live, 1-D."""

    def writable(self, group: int):
        """A context in which ``weight_of`` of group ``group``'s fragments may be written."""


def offload_device(block) -> str:
    """``"none"``, ``"cpu"`` or ``"nvme"`` for an ``offload_optimizer`` / ``offload_param`` block."""
    return getattr(block, "device", "none") if block is not None else "none"


class PartitionedOptimizer:
    def __init__(self, optimizer, *, source: FragmentSource, partition_of, fragments: list[list[Fragment]],
                 params_of: dict[str, torch.nn.Parameter], laid_out: set[int], separate_master: bool,
                 offload=None, sub_group_size: int = 10**9, aio=None, dp_group=None) -> None:
        """``partition_of(g)``: this rank's part of group ``g``'s weights, contiguous (fragment ``f`` lies
        at ``[f.local, f.local + f.numel)``), copied for the fp32 master; without a separate master the
        optimizer steps ``source.weight_of(f)`` itself.  ``params_of``: the model parameter of each
        fragment name; ``laid_out``: ids of the parameters the strategy owns (others stay in the
        optimizer as they are)."""
        self.optimizer = optimizer
        self.dp_group = dp_group
        self.world = comm.get_world_size(dp_group)
        self.device = offload_device(offload)
        nvme = self.device == "nvme"
        self.master_buffers: list[torch.Tensor] | None = None
        if not nvme and (separate_master or self.device == "cpu"):
            target = torch.device("cpu") if self.device == "cpu" else None
            self.master_buffers = []
            for gi in range(len(fragments)):
                t = partition_of(gi)
                self.master_buffers.append(t.to(device=target or t.device, dtype=torch.float32, copy=True))
        self.fragments = fragments
        replace: dict[int, list[torch.Tensor]] = {}
        for gi, frags in enumerate(fragments):
            for f in frags:
                view = (self.master_buffers[gi][f.local : f.local + f.numel] if self.master_buffers is not None
                        else source.weight_of(f))
                f.tensor = torch.nn.Parameter(view, requires_grad=True)
                replace.setdefault(id(params_of[f.name]), []).append(f.tensor)
        if optimizer is not None:
            if optimizer.state:
                raise ValueError("the optimizer already has state; pass a freshly constructed optimizer to "
                                 "initialize() (ZeRO replaces its parameters by this rank's partition)")
            for group in optimizer.param_groups:  # a parameter owned elsewhere is dropped here
                group["params"] = [t for p in group["params"]
                                   for t in (replace.get(id(p), []) if id(p) in laid_out else [p])]
        self.swapper = None
        if nvme:  # the fp32 weights (and, once created, the optimizer states) move into files
            from shardwise.zero.offload import NvmeStore, OptimizerSwapper

            store = NvmeStore(offload.nvme_path, rank=comm.get_rank(),
                              threads=aio.thread_count if aio is not None else 1,
                              block_size=aio.block_size if aio is not None else 1 << 20,
                              queue_depth=aio.queue_depth if aio is not None else 8)
            self.swapper = OptimizerSwapper(store, optimizer, [f for fr in fragments for f in fr],
                                            sub_group_size=sub_group_size, buffer_count=offload.buffer_count,
                                            initial_value=lambda f: f.tensor.detach())

    @property
    def separate_master(self) -> bool:
        """True when the optimizer steps a copy of the weights (fp32 master, or offloaded)."""
        return self.master_buffers is not None or self.swapper is not None

    def all_fragments(self):
        for frags in self.fragments:
            yield from frags

    def batches(self):
        """Lists of fragments whose weights and optimizer states are resident (all of them at once,
        unless the optimizer is offloaded to NVMe: then one sub-group after another)."""
        if self.swapper is not None:
            yield from self.swapper.batches()
        else:
            yield list(self.all_fragments())

    # -- what a checkpoint asks, the same for every partitioned stage --------------------------
    def fragment_at(self, name: str, start: int, end: int) -> Fragment:
        for f in self.all_fragments():
            if f.name == name and f.param_start == start:
                return f
        raise KeyError(f"{name}[{start}:{end}] is not owned by this rank")

    def fragment_batches(self):
        """Per resident batch: (name, param_start, param_end, optimizer tensor) of each fragment."""
        for frags in self.batches():
            yield [(f.name, f.param_start, f.param_end, f.tensor) for f in frags]

    def local_fragments(self):
        """(name, param_start, param_end, optimizer tensor = fp32 weights) for every owned fragment."""
        for f in self.all_fragments():
            yield f.name, f.param_start, f.param_end, f.tensor

    # -- the step ---------------------------------------------------------------------------
    def step(self, source: FragmentSource, *, precision, loss_scale: float, clip: float) -> StepResult:
        """Global norm over every rank's partition (one all-reduce, which also spreads an overflow),
        then unscale/clip/step every resident batch."""
        sq = grad_sq_sum(source.owned_grads())
        if self.world > 1:
            comm.all_reduce(sq, group=self.dp_group)
        norm, coef = unscale_and_clip(sq, loss_scale=loss_scale, clip=clip, check_overflow=precision.check_overflow)
        if coef is None:
            return StepResult(grad_norm=norm, overflow=True)
        for frags in self.batches():
            self.step_batch(frags, source, coef)
        return StepResult(grad_norm=norm, overflow=False)

    def step_batch(self, frags: list[Fragment], source: FragmentSource, coef: float) -> None:
        """Step the (resident) fragments ``frags``: fp32 gradients, times ``coef``, optimizer, write back."""
        grads = [source.grad_of(f) for f in frags]
        if self.separate_master or grads and grads[0].dtype != torch.float32:
            grads = [g.to(device=f.tensor.device, dtype=torch.float32, copy=True) for g, f in zip(grads, frags)]
        apply_coefficient_(grads, coef)
        for f, g in zip(frags, grads):
            f.tensor.grad = g.view_as(f.tensor)
        self._optimizer_step(frags)
        for f in frags:
            f.tensor.grad = None
        if self.separate_master:
            by_group: dict[int, list[Fragment]] = {}
            for f in frags:
                by_group.setdefault(f.group, []).append(f)
            for gi, fs in by_group.items():
                with source.writable(gi):
                    for f in fs:
                        source.weight_of(f).copy_(f.tensor.detach().reshape(-1))

    def _optimizer_step(self, frags: list[Fragment]) -> None:
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

    # -- introspection ----------------------------------------------------------------------
    def master_bytes(self) -> int:
        return sum(t.nbytes for t in self.master_buffers) if self.master_buffers is not None else 0

    def disk_bytes(self) -> int:
        return self.swapper.store.disk_bytes() if self.swapper is not None else 0

