"""The small interface every ZeRO stage implements, and the factory.

The engine calls only these methods, in this order, per micro-step:
``prepare_backward(boundary=..., no_sync=...)`` -> autograd runs (hooks reduce gradients as
they become ready) -> ``finish_backward()``; and at an accumulation
boundary ``step(...)`` then ``zero_grad()``.  Stages 1-3 and offload are
further implementations of this class; the engine does not branch on stage.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ReduceSettings:
    """How gradients are reduced across the data-parallel group."""

    bucket_elements: int = 500_000_000
    average: bool = True  # gradient_allreduce_op "mean"
    prescale: bool = False  # prescale_gradients: divide by world size before the sum
    predivide_factor: float = 1.0  # gradient_predivide_factor
    comm_dtype: torch.dtype | None = None  # communication_data_type


@dataclass(frozen=True)
class StepResult:
    grad_norm: float  # global L2 norm of the unscaled gradients, before clipping
    overflow: bool  # True: inf/nan found, the optimizer step was skipped


class ZeroStrategy(abc.ABC):
    stage: int

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

    @property
    def gathers_module_state(self) -> bool:
        """True when ``module_state_dict`` is collective (every rank must call it)."""
        return self.stage == 3

    def master_named_params(self) -> dict[str, torch.Tensor]:
        """This rank's fp32 weights by ``name`` (stage 0) or ``name@start:end`` (partitioned stages)."""
        return {name if self.replicated else f"{name}@{start}:{end}": t.detach()
                for name, start, end, t in self.local_fragments()}

    replicated: bool  # True when every rank holds the whole optimizer state (stage 0)

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
            from shardwise import comm

            comm.all_reduce(out, group=self.dp_group)
        return out.view(shape)


def build_strategy(zero_config, *, aio=None, **kwargs) -> ZeroStrategy:
    """The strategy for ``zero_config.stage`` (a ``zero_optimization`` config block)."""
    stage = int(zero_config.stage)
    module = kwargs.pop("module")
    opt_off = getattr(zero_config.offload_optimizer, "device", "none")
    param_off = getattr(zero_config.offload_param, "device", "none")
    if opt_off != "none" and stage == 0:
        raise ValueError("zero_optimization.offload_optimizer needs ZeRO stage 1, 2 or 3 (stage is 0)")
    if param_off != "none" and stage != 3:
        raise ValueError(f"zero_optimization.offload_param needs ZeRO stage 3 (stage is {stage})")
    if stage == 3:
        from shardwise.zero.stage3 import Stage3Strategy

        return Stage3Strategy(module=module, zero_config=zero_config, aio=aio, **kwargs)
    if stage == 0:
        from shardwise.zero.stage0 import DataParallelStrategy

        return DataParallelStrategy(**kwargs)
    if stage in (1, 2):
        from shardwise.zero.stage12 import PartitionedStrategy

        return PartitionedStrategy(
            stage=stage,
            allgather_bucket_elements=int(zero_config.allgather_bucket_size),
            use_reduce_scatter=bool(zero_config.reduce_scatter),
            offload_optimizer=zero_config.offload_optimizer,
            sub_group_size=int(zero_config.sub_group_size),
            aio=aio,
            **kwargs,
        )
    raise ValueError(f"not implemented yet: zero_optimization.stage={stage}")
