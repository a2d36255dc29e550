"""The optimizer step on this rank's partition, shared by ZeRO stages 1, 2 and 3.

A rank owns pieces of parameters ("fragments": ``name[param_start:param_end]``).
The optimizer steps one 1-D fp32 tensor per fragment, so param groups keep their
own hyper-parameters and checkpoints can name every piece.  That tensor is a view
of the model's own weights (fp32 training), or of a separate fp32 copy (16-bit
training, CPU offload), or lives in a file between steps (NVMe offload, where
``OptimizerSwapper`` swaps sub-groups in one after the other).

The strategies compose a ``PartitionedOptimizer`` and give it, once, where each
fragment's reduced gradient and its model weights live (a ``FragmentSource``:
stages 1-2 a ``FlatSource``, the flat buffers and their gradient store; stage 3
the strategy itself, whose shards may move).  ``grad_norm_sq`` reports this rank's share of the squared
norm; ``apply_step`` steps with the coefficient the caller derived from the sum
over every rank; ``step_batch`` steps one resident list of fragments.

With the optimizer offloaded (cpu or nvme), the step of the accumulation boundary
overlaps backward when its result cannot depend on what backward has yet to
produce: no gradient clipping and no overflow check (fp32, or bf16 with
``check_grad_overflow: false``).  Then ``arm`` (before the boundary backward)
starts a worker thread that steps sub-group after sub-group (``sub_group_size``
elements) as soon as every gradient in it is reduced (``grads_ready``, from the
bucket reducer), while autograd computes the rest; with NVMe it also reads the
next sub-groups and writes the previous ones meanwhile.  The norm is then taken
as usual (``grad_norm_sq``) and ``apply_step`` only waits for the worker and
steps what is left.  Every sub-group
steps exactly as in the plain step (same kernels, same coefficient 1.0), so the
result is bitwise the same.  With clipping or fp16/bf16 overflow checks the
global norm (all gradients, all ranks) decides the coefficient or whether the
step happens at all, so the step runs after backward as before (see docs/zero.md).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Protocol

import torch

from shardwise import comm
from shardwise.precision import apply_coefficient_, grad_sq_sum


class Fragment:
    """One optimizer tensor: ``name[param_start:param_end]``; ``group`` is the index of the flat group
    (stages 1-2) or unit (stage 3), ``buffer_start`` the offset in that group's flat buffer and
    ``local`` the offset in this rank's partition of it."""

    __slots__ = ("name", "group", "param_start", "param_end", "buffer_start", "local", "tensor", "numel")

    def __init__(self, name, group, param_start, param_end, buffer_start, local, tensor=None) -> None:
        self.name, self.group = name, group
        self.param_start, self.param_end = param_start, param_end
        self.buffer_start, self.local, self.tensor = buffer_start, local, tensor
        self.numel = param_end - param_start


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

    overlap_safe: bool  # True when ``writable`` may run on another thread while backward runs


class FlatSource:
    """The ``FragmentSource`` of flat buffers (stages 1-2): weights in each group's ``param_buffer``,
    gradients in the gradient store (``zero/buckets.py``), set once the strategy made it."""

    overlap_safe = True  # weights are written in memory (each rank its own chunks, of finished buckets)

    def __init__(self, groups, gradients=None) -> None:
        self.groups, self.gradients = groups, gradients

    def owned_grads(self) -> list[torch.Tensor]:
        return self.gradients.owned_grads()

    def grad_of(self, f: Fragment) -> torch.Tensor:
        return self.gradients.grad_of(f)

    def weight_of(self, f: Fragment) -> torch.Tensor:
        return self.groups[f.group].param_buffer[f.buffer_start : f.buffer_start + f.numel]

    def writable(self, group: int):
        return contextlib.nullcontext()


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
        self.source = source  # where gradients and weights live (the methods below default to it)
        self.bucket_fragments: list[list[Fragment]] = []  # per reduced bucket: the fragments it completes
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
                # which weight, and where in it (for optimizers that need whole matrices: Muon)
                f.tensor.zero_whole, f.tensor.zero_range = params_of[f.name], (f.param_start, f.param_end)
                replace.setdefault(id(params_of[f.name]), []).append(f.tensor)
        if optimizer is not None:
            if optimizer.state:
                raise ValueError("the optimizer already has state; pass a freshly constructed optimizer to "
                                 "initialize() (ZeRO replaces its parameters by this rank's partition)")
            for group in optimizer.param_groups:  # a parameter owned elsewhere is dropped here
                group["params"] = [t for p in group["params"]
                                   for t in (replace.get(id(p), []) if id(p) in laid_out else [p])]
            if hasattr(optimizer, "partitioned"):  # it steps whole matrices from fragments (Muon)
                optimizer.partitioned(dp_group=dp_group)
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
        from shardwise.zero.offload import StepTrace, cut_subgroups

        # The units the overlapped step steps: NVMe's swap sub-groups, or the same cut of the CPU masters.
        self.subgroups: list[list[Fragment]] = (
            [sg.frags for sg in self.swapper.subgroups] if self.swapper is not None
            else cut_subgroups([f for fr in fragments for f in fr], sub_group_size))
        self._subgroup_of = {id(f): k for k, frags in enumerate(self.subgroups) for f in frags}
        self.trace = self.swapper.trace if self.swapper is not None else StepTrace()
        # Overlap the boundary step with backward (offload only; see the module docstring).  Switch it off
        # with ``engine.strategy.partition.overlap_step = False``.
        self.overlap_step = self.device in ("cpu", "nvme") and optimizer is not None
        self._last_fixed = False  # the last step's coefficient was 1.0 whatever the gradients
        self._overlap: _Overlap | None = None

    @property
    def step_in_flight(self) -> bool:
        """True between a boundary backward whose step overlaps it and ``apply_step``: sub-groups may
        have stepped already, with the gradients backward produced."""
        return self._overlap is not None

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
        if self._overlap is not None:  # (a checkpoint between backward and step) the worker finishes first
            self._overlap.join()
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
    def grad_norm_sq(self, source: FragmentSource | None = None, *, counted=None) -> torch.Tensor:
        """Sum of squares of this rank's reduced (still scaled) gradients, fp32, no collective. With
        ``counted`` (a predicate on parameter names) only the fragments of the parameters it accepts."""
        source = self.source if source is None else source
        if counted is None:
            return grad_sq_sum(source.owned_grads())
        return grad_sq_sum([source.grad_of(f) for f in self.all_fragments() if counted(f.name)])

    def apply_step(self, source: FragmentSource | None = None, *, coef: float, coef_fixed: bool = False) -> None:
        """Multiply the gradients by ``coef`` and step every resident batch (what the overlapped step
        left, if it ran). ``coef_fixed``: the coefficient is 1.0 whatever the gradients (loss scale 1, no
        clipping, no overflow check), so the next boundary step may overlap backward."""
        source = self.source if source is None else source
        overlap, self._overlap = self._overlap, None
        done: set[int] = set()
        if overlap is not None:
            overlap.join()
            done = overlap.done
            if not coef_fixed or coef != 1.0:
                raise RuntimeError("the offloaded optimizer step overlapped backward assuming a fixed coefficient "
                                   f"1.0 (loss scale 1, no clipping, no overflow check), but the step has {coef}")
            if _hyper(self.optimizer) != overlap.hyper:
                raise RuntimeError(
                    "the optimizer's hyper-parameters (lr, betas, weight decay, ...) changed between "
                    "engine.backward() and engine.step(): with offload_optimizer the step of each sub-group "
                    "runs during the boundary backward, with the values it had then. Change them before "
                    "backward, or set engine.strategy.partition.overlap_step = False")
        elif self.trace.events:
            self.trace.clear()
        self._last_fixed = bool(coef_fixed)
        if overlap is None:
            for frags in self.batches():
                self.step_batch(frags, source, coef)
            return
        left = [k for k in range(len(self.subgroups)) if k not in done]
        if self.swapper is not None:
            batches = self.swapper.batches([self.swapper.subgroups[k] for k in left])
        else:
            batches = (self.subgroups[k] for k in left)
        for frags, k in zip(batches, left):  # (batches first: it runs to its end, the last write included)
            self._step_subgroup(k, frags, source, coef)
        others = self._others if self.swapper is None else []  # (as the plain step: NVMe steps fragments only)
        if others:
            self._step_params(others)

    # -- the step overlapped with backward --------------------------------------------------
    def arm(self, source: FragmentSource | None = None) -> None:
        """Before the boundary backward: start stepping sub-groups as their gradients are reduced, if
        the step cannot depend on the rest (the last step's coefficient was fixed: loss scale 1, no
        clipping and no overflow check; the first step never overlaps, it learns this)."""
        source = self.source if source is None else source
        if self._overlap is not None:  # the previous boundary backward never reached step()
            stale, self._overlap = self._overlap, None
            stale.cancel()
            if stale.done:
                raise RuntimeError("a boundary backward ran again before engine.step(): the offloaded "
                                   "optimizer had already stepped sub-groups with the previous gradients")
        if not (self.overlap_step and self._last_fixed and getattr(source, "overlap_safe", False)
                and self.subgroups):
            return
        self.trace.clear()
        self._overlap = _Overlap(self, source)

    def bucket_reduced(self, bucket) -> None:
        """The reducer's call-back (``BucketReducer(on_reduced=)``, offloaded steps only): ``bucket`` is reduced."""
        self.grads_ready(self.bucket_fragments[bucket.index])

    def grads_ready(self, frags: list[Fragment]) -> None:
        """The reduced gradients of ``frags`` are final for this step (called as buckets complete)."""
        if self._overlap is not None:
            self._overlap.ready([self._subgroup_of[id(f)] for f in frags])

    def backward_finished(self) -> None:
        """Backward (and every reduction) is over: every gradient is final."""
        if self._overlap is not None:
            self.trace.record("backward_end")
            self._overlap.ready(range(len(self.subgroups)), all_of_them=True)

    @property
    def _others(self) -> list[torch.Tensor]:
        """Optimizer parameters that are no fragment (not laid out by the strategy): a plain step has them."""
        if self.optimizer is None:
            return []
        mine = {id(f.tensor) for f in self.all_fragments()}
        return [p for g in self.optimizer.param_groups for p in g["params"] if id(p) not in mine]

    def _step_subgroup(self, k: int, frags: list[Fragment], source: FragmentSource, coef: float) -> None:
        self.trace.record("step_start", k)
        self.step_batch(frags, source, coef, subset=True)
        self.trace.record("step_end", k)

    def step_batch(self, frags: list[Fragment], source: FragmentSource, coef: float, *, subset: bool = False) -> None:
        """Step the (resident) fragments ``frags``: fp32 gradients, times ``coef``, optimizer, write back.
        ``subset``: step only these (else a plain ``optimizer.step()`` unless the optimizer is on NVMe)."""
        grads = [source.grad_of(f) for f in frags]
        if self.separate_master or grads and grads[0].dtype != torch.float32:
            grads = [g.to(device=f.tensor.device, dtype=torch.float32, copy=True) for g, f in zip(grads, frags)]
        apply_coefficient_(grads, coef)
        for f, g in zip(frags, grads):
            f.tensor.grad = g.view_as(f.tensor)
        if subset or self.swapper is not None:
            self._step_params([f.tensor for f in frags])
        else:
            self.optimizer.step()
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

    def _step_params(self, params: list[torch.Tensor]) -> None:
        """``optimizer.step()`` on just ``params`` (the others are hidden from it meanwhile)."""
        wanted = {id(t) for t in params}
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



def _hyper(optimizer) -> list[dict]:
    """The param groups' hyper-parameters (everything but ``params``), comparable with ``==``."""
    out = []
    for g in optimizer.param_groups:
        out.append({k: (("tensor", v.detach().cpu().tolist()) if isinstance(v, torch.Tensor) else v)
                    for k, v in g.items() if k != "params"})
    return out


class _Overlap:
    """One boundary backward's overlapped step: a worker thread steps sub-group after sub-group, in
    order, each once its gradients are final; with NVMe it swaps them in ahead and out behind."""

    def __init__(self, owner: PartitionedOptimizer, source: FragmentSource) -> None:
        self.owner = owner
        self.hyper = _hyper(owner.optimizer)
        self.left = [len(frags) for frags in owner.subgroups]  # gradients still to come, per sub-group
        self.done: set[int] = set()
        self.error: BaseException | None = None
        self._cancelled = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, args=(source,), name="shardwise-offload-step",
                                        daemon=True)
        self._thread.start()

    def ready(self, subgroups, *, all_of_them: bool = False) -> None:
        with self._cond:
            for k in subgroups:
                self.left[k] = 0 if all_of_them else self.left[k] - 1
            self._cond.notify()

    def cancel(self) -> None:
        with self._cond:
            self._cancelled = True
            self._cond.notify()
        self._thread.join()

    def join(self) -> None:
        self._thread.join()
        if self.error is not None:
            error, self.error = self.error, None
            raise error

    def _wait(self, k: int) -> bool:
        with self._cond:
            while self.left[k] > 0 and not self._cancelled:
                self._cond.wait()
            return not self._cancelled

    def _run(self, source: FragmentSource) -> None:
        owner = self.owner
        try:
            order = range(len(owner.subgroups))
            batches = owner.swapper.batches() if owner.swapper is not None else (owner.subgroups[k] for k in order)
            try:
                for frags, k in zip(batches, order):
                    if not self._wait(k):
                        break
                    owner._step_subgroup(k, frags, source, 1.0)
                    self.done.add(k)
            finally:
                if hasattr(batches, "close"):
                    batches.close()  # the last write-behind finishes here
        except BaseException as e:  # re-raised by join() on the main thread
            self.error = e
