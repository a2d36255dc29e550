"""The top level of the DeepSpeed-format config: ``ShardwiseConfig``."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Annotated, Any, Callable, ClassVar, Literal

from pydantic import BeforeValidator, Field, PlainValidator, model_validator
from pydantic_core import PydanticCustomError

from .errors import describe_value
from .compile import CompileConfig
from .hybrid import HybridEngineConfig
from .fault_tolerance import FaultToleranceConfig
from .base import ConfigModel, Float, Int, OptDType, is_default, not_implemented
from .monitors import (AutotuningConfig, CometConfig, CommsLoggerConfig, CSVMonitorConfig,
                       ElasticityConfig, FlopsProfilerConfig, TensorBoardConfig, TimersConfig, WandbConfig)
from .precision import AmpConfig, BF16Config, DataTypesConfig, FP16Config, TorchAutocastConfig, param_dtype_conflict
from .training import (ActivationCheckpointingConfig, AioConfig, CheckpointConfig, OptimizerConfig,
                       PipelineConfig, SchedulerConfig)
from .tensor_parallel import TensorParallelConfig
from .expert_parallel import ExpertParallelConfig
from .zero import ZeroConfig

if TYPE_CHECKING:  # pragma: no cover
    from .batch import BatchSizes
    from .loader import Report

__all__ = ["ShardwiseConfig", "OTHER_BLOCKS"]

PositiveInt = Annotated[Int, Field(gt=0)]


def _steps_per_print(value: Any) -> int | float:
    if isinstance(value, float) and value == math.inf:
        return value
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise PydanticCustomError("shardwise_type",
                                  f"expected a positive integer (or Infinity for never), got {describe_value(value)}")
    return value


# a positive integer, or infinity: accelerate writes float("inf") for "never print"
StepsPerPrint = Annotated[int | float, PlainValidator(_steps_per_print)]


def _allreduce_op(value: Any) -> Any:
    if isinstance(value, str) and value.lower() in ("mean", "sum"):
        return value.lower()
    # DeepSpeed's words first ("Invalid gradient_allreduce_op"), so code matching them still does
    raise PydanticCustomError("shardwise_value", "Invalid gradient_allreduce_op {got}: expected 'mean' or 'sum'",
                              {"got": describe_value(value)})


AllreduceOp = Annotated[Literal["mean", "sum"], BeforeValidator(_allreduce_op)]

# Blocks of features we accept as keys but do not model yet: free-form, and an
# error from check_supported() as soon as they are switched on.
OTHER_BLOCKS = (
    "sparse_attention", "eigenvalue",
    "progressive_layer_drop", "data_efficiency", "curriculum_learning", "compression_training",
    "nebula",
)


def _block(factory):
    return Field(default_factory=factory)


def _refuse_sum_with(data: dict[str, Any], report: "Report") -> None:
    """``gradient_allreduce_op: sum`` beside ZenFlow or DeepCompile: refused first in DeepSpeed's words (shardwise
    implements neither, so each is refused again on its own below)."""
    if not (isinstance(data.get("gradient_allreduce_op"), str) and data["gradient_allreduce_op"].lower() == "sum"):
        return
    zero, compile_ = data.get("zero_optimization"), data.get("compile")
    if isinstance(zero, dict) and zero.get("zenflow") is not None:
        report.problem("gradient_allreduce_op: 'sum' is not supported with ZenFlow (zero_optimization.zenflow)")
    if isinstance(compile_, dict) and compile_.get("deepcompile") is True:
        report.problem("gradient_allreduce_op: 'sum' is not supported with DeepCompile (compile.deepcompile)")


class ShardwiseConfig(ConfigModel):
    """A validated DeepSpeed-format config. Build it with :func:`shardwise.config.load_config`."""

    # batch triad: None = unset, see resolve_batch_sizes()
    train_batch_size: PositiveInt | None = None
    train_micro_batch_size_per_gpu: PositiveInt | None = None
    gradient_accumulation_steps: PositiveInt | None = None
    steps_per_print: StepsPerPrint | None = None
    wall_clock_breakdown: bool = False
    # ours: the accelerator's peak TFLOP/s for the MFU figure in the logs (default: a table by device name)
    peak_tflops: Float | None = Field(None, gt=0)
    memory_breakdown: bool = False
    dump_state: bool = False

    optimizer: OptimizerConfig | None = None
    scheduler: SchedulerConfig | None = None
    zero_allow_untested_optimizer: bool = False
    zero_force_ds_cpu_optimizer: bool = True

    fp16: FP16Config = _block(FP16Config)
    bf16: BF16Config = _block(BF16Config)
    amp: AmpConfig = _block(AmpConfig)
    torch_autocast: TorchAutocastConfig = _block(TorchAutocastConfig)
    data_types: DataTypesConfig = _block(DataTypesConfig)

    gradient_clipping: Float = Field(1.0, ge=0)
    communication_data_type: OptDType = None
    # Ulysses sequence parallelism (docs/sequence-parallel.md): ranks per sequence-parallel group, and the
    # dtype gradients are reduced in when it is > 1 (DeepSpeed's default fp32)
    sequence_parallel_size: int = Field(1, ge=1)
    seq_parallel_communication_data_type: OptDType = "fp32"
    prescale_gradients: bool = False
    gradient_predivide_factor: Float = Field(1.0, gt=0)
    gradient_allreduce_op: AllreduceOp = "mean"
    sparse_gradients: bool = False
    disable_allgather: bool = False
    # ours: seconds a collective may take before every rank reports it (docs/comms.md)
    comm_timeout: Float | None = Field(None, gt=0)

    zero_optimization: ZeroConfig = _block(ZeroConfig)
    aio: AioConfig = _block(AioConfig)
    activation_checkpointing: ActivationCheckpointingConfig = _block(ActivationCheckpointingConfig)
    pipeline: PipelineConfig = _block(PipelineConfig)
    checkpoint: CheckpointConfig = _block(CheckpointConfig)
    dataloader_drop_last: bool = False

    flops_profiler: FlopsProfilerConfig = _block(FlopsProfilerConfig)
    tensorboard: TensorBoardConfig = _block(TensorBoardConfig)
    csv_monitor: CSVMonitorConfig = _block(CSVMonitorConfig)
    wandb: WandbConfig = _block(WandbConfig)
    comet: CometConfig = _block(CometConfig)
    comms_logger: CommsLoggerConfig = _block(CommsLoggerConfig)
    autotuning: AutotuningConfig = _block(AutotuningConfig)
    elasticity: ElasticityConfig = _block(ElasticityConfig)

    tensor_parallel: TensorParallelConfig = _block(TensorParallelConfig)
    expert_parallel: ExpertParallelConfig = _block(ExpertParallelConfig)
    hybrid_engine: HybridEngineConfig = _block(HybridEngineConfig)
    compile: CompileConfig = _block(CompileConfig)
    fault_tolerance: FaultToleranceConfig = _block(FaultToleranceConfig)  # ours: replica groups on torchft
    sparse_attention: dict[str, Any] = _block(dict)
    eigenvalue: dict[str, Any] = _block(dict)
    progressive_layer_drop: dict[str, Any] = _block(dict)
    data_efficiency: dict[str, Any] = _block(dict)
    curriculum_learning: dict[str, Any] = _block(dict)
    compression_training: dict[str, Any] = _block(dict)
    nebula: dict[str, Any] = _block(dict)
    timers: TimersConfig = _block(TimersConfig)

    renamed: ClassVar[dict[str, str]] = {"bfloat16": "bf16"}

    # DeepSpeed 0.19.8's other top-level keys: the default passes, any other value is refused with its reason
    refused: ClassVar[dict[str, tuple[Callable[[Any], bool], str]]] = {
        "managed_gradient_accumulation": (is_default(True), not_implemented(
            "false (the caller owns the accumulation boundary and every step() updates)",
            "the engine counts micro-batches with gradient_accumulation_steps: remove the key")),
        "disable_python_gc": (is_default(False), not_implemented(
            "pausing Python's cyclic garbage collector during training")),
        "use_data_before_expert_parallelism": (is_default(False), not_implemented(
            "laying out the expert groups data-first from the config")),
        "log_level": (is_default(None), not_implemented(
            "setting DeepSpeed's log level from the config",
            "set the level of the 'shardwise' logger with Python's logging: remove the key")),
        "datastates_ckpt": (lambda v: v is None or v is False, not_implemented(
            "DataStates-LLM asynchronous checkpointing", "docs/checkpoints.md describes the checkpoint options "
            "shardwise has: remove the block")),
        "weight_quantization": (is_default(None), not_implemented(
            "quantized weight initialisation (weight_quantization)", "remove the block")),
        "vocabulary_size": (is_default(None), not_implemented(
            "DeepSpeed's fp16 warning for a vocabulary that is not a multiple of 8, the key's only use,")),
        # removed from DeepSpeed (its _REMOVED_TOP_LEVEL_CONFIG_KEYS): refused there whatever the value
        "graph_harvesting": (lambda v: False, "graph harvesting was removed from DeepSpeed (refused since 0.19.8, "
                             "https://github.com/deepspeedai/DeepSpeed/issues/8489) and is not implemented in "
                             "shardwise: remove the key"),
        "quantize_training": (lambda v: False, "Mixture-of-Quantization (quantize_training) was removed from "
                              "DeepSpeed (refused since 0.19.8, https://github.com/deepspeedai/DeepSpeed/issues/8489) "
                              "and is not implemented in shardwise: remove the block"),
    }

    @classmethod
    def upgrade(cls, data: dict[str, Any], path: str, report: "Report") -> dict[str, Any]:
        data = super().upgrade(data, path, report)
        zero = data.get("zero_optimization")
        if isinstance(zero, bool):
            stage = 1 if zero else 0
            report.warn(f"\"zero_optimization\": {str(zero).lower()} is deprecated; "
                        f"write \"zero_optimization\": {{\"stage\": {stage}}} instead")
            data["zero_optimization"] = {"stage": stage}
        _refuse_sum_with(data, report)
        return data

    @model_validator(mode="after")
    def _check_combinations(self) -> "ShardwiseConfig":
        clashes = []
        if self.fp16.enabled and self.bf16.enabled:
            clashes.append("fp16.enabled and bf16.enabled are both true; enable at most one")
        if self.amp.enabled and (self.fp16.enabled or self.bf16.enabled):
            clashes.append("amp.enabled cannot be combined with fp16.enabled or bf16.enabled")
        if self.amp.enabled and self.zero_optimization.stage > 0:
            clashes.append("amp.enabled cannot be combined with zero_optimization.stage > 0")
        tp_dtype = self.tensor_parallel.dtype
        trains_in = "fp16" if self.fp16.enabled else "bf16" if self.bf16.enabled else "fp32"
        if tp_dtype is not None and tp_dtype != trains_in:
            clashes.append(f"tensor_parallel.dtype is {tp_dtype} but the model trains in {trains_in} "
                           "(fp16/bf16 blocks); make them agree or drop tensor_parallel.dtype")
        conflict = param_dtype_conflict(self.data_types.param_dtype, fp16=self.fp16.enabled, bf16=self.bf16.enabled)
        if conflict:
            clashes.append(conflict)
        if clashes:
            raise PydanticCustomError("shardwise_conflict", "; ".join(clashes))
        return self

    # ---- API used by the engine -------------------------------------------------
    def resolve_batch_sizes(self, dp_world_size: int) -> "BatchSizes":
        """Complete the batch triad for ``dp_world_size`` data-parallel ranks (DeepSpeed's rules)."""
        from .batch import resolve_batch_sizes
        if self.elasticity.enabled:  # the elasticity block computes the triad (shardwise.elasticity)
            from shardwise.elasticity.elasticity import elastic_batch_sizes
            return elastic_batch_sizes(self, dp_world_size)
        return resolve_batch_sizes(self.train_batch_size, self.train_micro_batch_size_per_gpu,
                                   self.gradient_accumulation_steps, dp_world_size=dp_world_size)

    def check_supported(self) -> None:
        """Raise ConfigError naming every enabled feature that shardwise does not implement yet."""
        from .support import check_supported
        check_supported(self)

    def get(self, key: str, default: Any = None) -> Any:
        """Dict-style read in the JSON layout, as code written for DeepSpeed reads ``engine.config``
        (Hugging Face's Trainer: ``engine.config.get("zero_optimization", {}).get("stage")``)."""
        if key not in type(self).model_fields:
            return default
        value = getattr(self, key)
        return value.model_dump() if isinstance(value, ConfigModel) else value

    def __getitem__(self, key: str) -> Any:
        """``engine.config["zero_optimization"]["stage"]``, in the JSON layout as ``get``: DeepSpeed's
        ``engine.config`` is the config dict (OpenRLHF reads ``["zero_optimization"]["offload_optimizer"]``)."""
        if key not in type(self).model_fields:
            raise KeyError(key)
        return self.get(key)

    def to_dict(self) -> dict[str, Any]:
        """The effective config as plain JSON-able data (loadable again with load_config)."""
        return self.model_dump(mode="json")
