"""Blocks about the training loop: optimizer, scheduler, checkpointing, pipeline, I/O."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from .base import ConfigModel, Int, case_insensitive

__all__ = [
    "OptimizerConfig", "SchedulerConfig", "ActivationCheckpointingConfig", "PipelineConfig",
    "CheckpointConfig", "CheckpointWriterConfig", "ParallelWriteConfig", "AioConfig",
]


class OptimizerConfig(ConfigModel):
    """``type`` names the optimizer; ``params`` go to its constructor and are checked by the optim package."""

    type: str = Field(min_length=1)
    params: dict[str, Any] = Field(default_factory=dict)


class SchedulerConfig(ConfigModel):
    type: str = Field(min_length=1)
    params: dict[str, Any] = Field(default_factory=dict)


class ActivationCheckpointingConfig(ConfigModel):
    partition_activations: bool = False
    cpu_checkpointing: bool = False
    contiguous_memory_optimization: bool = False
    number_checkpoints: Int | None = Field(None, gt=0)
    synchronize_checkpoint_boundary: bool = False
    profile: bool = False


class PipelineConfig(ConfigModel):
    # DeepSpeed declares stages/partition/seed_layers but never reads them;
    # ``stages`` None stands for DeepSpeed's "auto".
    stages: Int | None = Field(None, gt=0)
    partition: str = "best"
    seed_layers: bool = False
    activation_checkpoint_interval: Int = Field(0, ge=0)
    pipe_partitioned: bool = True
    grad_partitioned: bool = True
    use_reentrant: bool = True


class ParallelWriteConfig(ConfigModel):
    pipeline_stage: bool = False


TagValidation = Annotated[Literal["Ignore", "Warn", "Fail"], case_insensitive("Ignore", "Warn", "Fail")]


WriterType = Annotated[Literal["mock", "python", "fast"], case_insensitive("mock", "python", "fast")]
WriterParallel = Annotated[Literal["replica", "socket", "machine"], case_insensitive("replica", "socket", "machine")]


class CheckpointWriterConfig(ConfigModel):
    """DeepSpeed's ``checkpoint.writer``; ``decoupled: true`` saves in the background (docs/checkpoints.md)."""

    type: WriterType = "fast"
    decoupled: bool = False
    io_buffer_size: Int = Field(64 * 1024**2, gt=0)
    io_buffer_double: bool = True
    show_statistics: bool = False
    data_parallel: WriterParallel | None = None
    io_multiplier: Int = Field(1, gt=0)


class CheckpointConfig(ConfigModel):
    tag_validation: TagValidation = "Warn"
    load_universal: bool = False
    use_node_local_storage: bool = False
    parallel_write: ParallelWriteConfig = Field(default_factory=ParallelWriteConfig)
    checkpoint_serialization: bool = True
    writer: CheckpointWriterConfig | None = None


class AioConfig(ConfigModel):
    block_size: Int = Field(1_048_576, gt=0)
    queue_depth: Int = Field(8, gt=0)
    thread_count: Int = Field(1, gt=0)
    single_submit: bool = False
    overlap_events: bool = True
