"""The small interface every ZeRO stage implements (the factory is ``zero/factory.py``).

The engine calls only these methods, in this order, per micro-step:
``prepare_backward(boundary=..., no_sync=...)`` -> autograd runs (hooks reduce gradients as
they become ready) -> ``finish_backward()``; and at an accumulation boundary the step
(``runtime/train_step.py: clipped_step``): ``local_grad_norm_sq()`` on every rank, summed once over the
ranks holding other pieces, the overflow check and the coefficient (``shardwise.precision``), then
``apply_step(coef=...)``; then ``zero_grad()``.  Stages 1-3 and offload are further
implementations of this class; the engine does not branch on stage.

A strategy reduces over the data-parallel process group it is given (``dp_group``;
``None`` is the whole world), so a data x pipe x tensor grid hands it the data axis. Its ``layout``
(``zero/layout.py``) may put some parameters in other reduce domains: MoE experts reduce and are
partitioned over their expert-data-parallel group, and checkpoints name them by global index.
"""

from __future__ import annotations

import abc
import functools
from dataclasses import dataclass

import torch

from shardwise import comm
from shardwise.precision import StepResult  # noqa: F401 (re-exported)
from shardwise.zero.layout import ParamLayout

__all__ = ["ReduceSettings", "StepResult", "ZeroStrategy"]


@dataclass(frozen=True)
class ReduceSettings:
    """How gradients are reduced across the data-parallel group."""

    bucket_elements: int = 500_000_000
    bucket_size_given: bool = True  # False: the config left reduce_bucket_size at its default (stage 2 sizes its own)
    average: bool = True  # gradient_allreduce_op "mean"
    prescale: bool = False  # prescale_gradients: divide by world size before the sum
    predivide_factor: float = 1.0  # gradient_predivide_factor
    comm_dtype: torch.dtype | None = None  # communication_data_type


class ZeroStrategy(abc.ABC):
    stage: int  # the ZeRO stage number: the memory report picks its formula by it, checkpoints record it;
    # the training step never branches on it
    replicated: bool  # True when every rank holds the whole optimizer state (stage 0)
    shards_gradients = False  # True when a rank keeps only its share of the reduced gradients (stages 2-3)
    shards_parameters = False  # True when a rank keeps only its share of the weights (stage 3)
    _reduce_gradients = True
    layout: ParamLayout = ParamLayout()  # the reduce domains and saved names (a model with experts: its own)

    @property
    def gathers_module_state(self) -> bool:
        """True when ``module_state_dict`` is collective (stage 3; experts gathered over their groups)."""
        return self.layout.has_experts

    @property
    def saved_names(self) -> dict[str, str]:
        """``{module name: name in fragments and checkpoints}`` where they differ (experts: global index)."""
        return self.layout.saved_names

    @property
    def held_elsewhere(self) -> frozenset[str]:
        """Names of a whole-model state dict this rank does not hold (other expert-parallel ranks' experts)."""
        return self.layout.held_elsewhere

    @property
    def saved_here(self):
        """None, or (with experts) ``saved_here(name)``: whether this rank writes ``name``'s fragments (a
        replicated stage: the first rank of the parameter's reduce domain)."""
        return self._saved_here if self.layout.has_experts else None

    def _saved_here(self, name: str) -> bool:
        if not self.replicated:
            return True
        return self._domain_rank.get(name, comm.get_rank(self.dp_group)) == 0

    @functools.cached_property
    def _domain_rank(self) -> dict[str, int]:
        return {n: g.domain.rank for g in getattr(self, "groups", []) if g.domain is not None for n in g.names}

    @property
    def reduce_gradients(self) -> bool:
        """Whether the coming backward passes reduce gradients across the data-parallel group.

        Set it to False when the optimizer exchanges gradient information itself, as 1-bit Adam does
        with compressed momentum after its warm-up (DeepSpeed's ``engine.enable_backward_allreduce``);
        each rank's ``param.grad`` is then its local gradient. Stage 0 allows it, and the compressed
        variant of stage 1 (``zero/compressed.py``)."""
        return self._reduce_gradients

    @reduce_gradients.setter
    def reduce_gradients(self, on: bool) -> None:
        if not on and not self.can_keep_local_gradients:
            raise ValueError(f"switching off the gradient reduction needs ZeRO stage 0 (stage is {self.stage}): "
                             "partitioned stages keep only their share of the reduced gradients")
        self._reduce_gradients = bool(on)

    @property
    def can_keep_local_gradients(self) -> bool:
        """Whether backward may leave each rank its own local gradients (``reduce_gradients`` False)."""
        return self.replicated

    @abc.abstractmethod
    def prepare_backward(self, *, boundary: bool, no_sync: bool = False) -> None:
        """Called before each backward: is it the accumulation boundary, is it inside ``engine.no_sync()``."""

    @abc.abstractmethod
    def finish_backward(self) -> None:
        """Called after each backward: flush outstanding reductions (if syncing) and wait for them."""

    @property
    def norm_is_local(self) -> bool:
        """True when ``local_grad_norm_sq`` already covers every element of this rank's part of the
        model (stage 0: every data rank holds the whole reduced gradients), so the norm is summed over
        the model-parallel ranks only; False when each data rank holds a disjoint share of it."""
        return self.replicated

    @abc.abstractmethod
    def local_grad_norm_sq(self, *, counted=None) -> torch.Tensor:
        """Sum of squares (fp32, 0-d) of the gradients this rank holds for its share, still loss-scaled;
        each element of the model counted once over the data axis (a replicated stage reports every
        element: the caller decides which ranks count). ``counted``: a predicate on parameter names,
        only those parameters count (tensor-replicated ones on one tensor rank, tied duplicates
        skipped). No collective."""

    @abc.abstractmethod
    def apply_step(self, *, coef: float, coef_fixed: bool = False) -> None:
        """Multiply the gradients by ``coef`` (unscale x clip), run the optimizer on this rank's share,
        write back / gather the weights. ``coef_fixed``: the coefficient is 1.0 whatever the gradients
        (loss scale 1, no clipping, no overflow check); an offloaded step may then overlap the next
        backward. Whether to skip an overflowing step is the caller's decision."""

    def overflow_anywhere(self, overflow: bool) -> bool:
        """Whether any rank found an inf/NaN, from this rank's finding on the summed norm. The norm was
        summed over every rank holding pieces, so they all found the same: nothing to agree on."""
        return overflow

    @abc.abstractmethod
    def zero_grad(self) -> None: ...

    def module_state_dict(self, module: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The whole model's state dict (collective when ``gathers_module_state``)."""
        return self.layout.whole_state(module, self.gather_module_state(module))

    def load_module_state_dict(self, module: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
        """Load a whole-model state dict (experts by global index: this rank's are taken)."""
        self.scatter_module_state(module, self.layout.local_state(state))

    def gather_module_state(self, module: torch.nn.Module) -> dict[str, torch.Tensor]:
        """This rank's module's full state dict (stage 3 gathers it; collective there)."""
        return module.state_dict()

    def scatter_module_state(self, module: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
        module.load_state_dict(state, strict=False)

    def master_named_params(self) -> dict[str, torch.Tensor]:
        """This rank's fp32 weights by ``name`` (stage 0) or ``name@start:end`` (partitioned stages)."""
        return {name if self.replicated else f"{name}@{start}:{end}": t.detach()
                for name, start, end, t in self.local_fragments()}

    @abc.abstractmethod
    def local_fragments(self):
        """Yield ``(param name, start, end, tensor)``: the optimizer tensors this rank steps, each
        holding elements ``[start, end)`` of the flattened fp32 parameter."""

    @abc.abstractmethod
    def local_grad(self, name: str, start: int, end: int) -> torch.Tensor:
        """This rank's reduced gradient for elements ``[start, end)`` of parameter ``name``."""

    def fragment_batches(self):
        """Lists of ``(name, start, end, tensor)`` whose tensors are resident while the list is in use
        (everything at once, except with NVMe offload)."""
        yield list(self.local_fragments())

    def gather_full(self, name: str, shape: torch.Size, what: str) -> torch.Tensor:
        """The whole fp32 ``param`` / ``grad`` / optimizer state ``what`` of one parameter, assembled
        from every rank's fragments. Collective for partitioned stages: call it on every rank."""
        out = None
        numel = 1
        for d in shape:
            numel *= d
        for fname, start, end, t in (x for batch in self.fragment_batches() for x in batch):
            if out is None:
                out = torch.zeros(numel, dtype=torch.float32, device=t.device)
            if fname != name:
                continue
            if what == "param":
                src = t
            elif what == "grad":
                src = self.local_grad(name, start, end)
            else:
                src = self.optimizer.state.get(t, {}).get(what) if self.optimizer is not None else None
                if src is None:
                    raise KeyError(f"no optimizer state '{what}' for {name} (has the optimizer stepped yet?)")
            out[start:end] = src.detach().reshape(-1).float()
        if out is None:
            out = torch.zeros(numel, dtype=torch.float32)
        if not self.replicated:
            comm.all_reduce(out, group=self.dp_group)
        return out.view(shape)
