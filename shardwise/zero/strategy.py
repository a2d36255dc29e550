"""The small interface every ZeRO stage implements (the factory is ``zero/factory.py``).

The engine calls only these methods, in this order, per micro-step:
``prepare_backward(boundary=..., no_sync=...)`` -> autograd runs (hooks reduce gradients as
they become ready) -> ``finish_backward()``; and at an accumulation
boundary ``step(...)`` then ``zero_grad()``.  Stages 1-3 and offload are
further implementations of this class; the engine does not branch on stage.

A strategy reduces over the data-parallel process group it is given (``dp_group``;
``None`` is the whole world), so a data x pipe x tensor grid hands it the data axis.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

import torch

from shardwise import comm
from shardwise.precision import StepResult

__all__ = ["ReduceSettings", "StepResult", "ZeroStrategy"]


@dataclass(frozen=True)
class ReduceSettings:
    """How gradients are reduced across the data-parallel group."""

    bucket_elements: int = 500_000_000
    average: bool = True  # gradient_allreduce_op "mean"
    prescale: bool = False  # prescale_gradients: divide by world size before the sum
    predivide_factor: float = 1.0  # gradient_predivide_factor
    comm_dtype: torch.dtype | None = None  # communication_data_type


class ZeroStrategy(abc.ABC):
    stage: int  # for reports and checkpoints only; nothing branches on it
    replicated: bool  # True when every rank holds the whole optimizer state (stage 0)
    shards_gradients = False  # True when a rank keeps only its share of the reduced gradients (stages 2-3)
    shards_parameters = False  # True when a rank keeps only its share of the weights (stage 3)
    gathers_module_state = False  # True when ``module_state_dict`` is collective (stage 3)
    _reduce_gradients = True
    # A partitioned stage that keeps whole local gradients (stage 1) can hand the step over to an
    # optimizer exchanging them itself: ``local_step(strategy, precision=, loss_scale=, clip=)``
    # runs instead of the partitioned step while ``reduce_gradients`` is False (1-bit Adam).
    local_step = None

    @property
    def reduce_gradients(self) -> bool:
        """Whether the coming backward passes reduce gradients across the data-parallel group.

        Set it to False when the optimizer exchanges gradient information itself, as 1-bit Adam does
        with compressed momentum after its warm-up (DeepSpeed's ``engine.enable_backward_allreduce``);
        each rank's ``param.grad`` is then its local gradient. Stage 0 allows it; stage 1 once such an
        optimizer has set ``local_step``."""
        return self._reduce_gradients

    @reduce_gradients.setter
    def reduce_gradients(self, on: bool) -> None:
        if not on and not self.replicated and self.local_step is None:
            raise ValueError(f"switching off the gradient reduction needs ZeRO stage 0 (stage is {self.stage}): "
                             "partitioned stages keep only their share of the reduced gradients")
        self._reduce_gradients = bool(on)

    @abc.abstractmethod
    def prepare_backward(self, *, boundary: bool, no_sync: bool = False) -> None:
        """Called before each backward: is it the accumulation boundary, is it inside ``engine.no_sync()``."""

    @abc.abstractmethod
    def finish_backward(self) -> None:
        """Called after each backward: flush outstanding reductions (if syncing) and wait for them."""

    @abc.abstractmethod
    def step(self, *, loss_scale: float, clip: float) -> StepResult:
        """Unscale, check overflow, clip and run the optimizer on this rank's share."""

    @abc.abstractmethod
    def zero_grad(self) -> None: ...

    def module_state_dict(self, module: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The module's full state dict (stage 3 gathers it; collective there)."""
        return module.state_dict()

    def load_module_state_dict(self, module: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
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
