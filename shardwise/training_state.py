"""What ``checkpoint/`` and ``monitor/`` see of an engine: a narrow, read-only view.

The engine builds a ``TrainingState`` when it calls them (references to its parts and a copy of
its counters) and a ``StepReport`` after each optimizer step.  Neither can write the engine's
counters: a checkpoint load returns the restored ``StepCounters`` and the engine applies them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StepCounters:
    global_steps: int = 0
    global_samples: int = 0
    micro_steps: int = 0
    skipped_steps: int = 0


@dataclass(frozen=True)
class TrainingState:
    module: Any  # torch.nn.Module
    strategy: Any  # shardwise.zero.ZeroStrategy
    optimizer: Any
    lr_scheduler: Any
    loss_scaler: Any  # None without fp16 loss scaling
    precision: Any  # shardwise.precision.PrecisionPolicy
    config: Any
    dp_group: Any
    dp_world_size: int
    global_rank: int
    device: Any
    training_dataloader: Any
    counters: StepCounters
    grid: Any = None  # shardwise.topology.ParallelGrid (tensor-parallel pieces in checkpoints)


@dataclass(frozen=True)
class StepReport:
    """One optimizer step, as the monitors see it."""

    loss: float | None  # mean loss of the step's micro-batches on this rank
    global_steps: int
    global_samples: int
    lr: float
    loss_scale: float | None  # None without fp16 loss scaling
    grad_norm: float | None
    batch_size: int  # train_batch_size
    timings: dict[str, float] | None  # seconds per timer of this step (wall_clock_breakdown), else None
