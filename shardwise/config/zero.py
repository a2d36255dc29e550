"""The ``zero_optimization`` block and its offload sub-blocks."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal

from pydantic import BeforeValidator, Field, model_validator

from .base import ConfigModel, Float, Int
from .errors import describe_value

if TYPE_CHECKING:  # pragma: no cover
    from .loader import Report

__all__ = ["OffloadParamConfig", "OffloadOptimizerConfig", "ZeroConfig"]


def _device(value: Any) -> Any:
    if value is None:
        return "none"
    return value.lower() if isinstance(value, str) else value


OffloadDevice = Annotated[Literal["none", "cpu", "nvme"], BeforeValidator(_device)]


class OffloadParamConfig(ConfigModel):
    device: OffloadDevice = "none"
    nvme_path: str | None = None
    buffer_count: Int = Field(5, gt=0)
    buffer_size: Int = Field(100_000_000, gt=0)
    max_in_cpu: Int = Field(1_000_000_000, ge=0)
    pin_memory: bool = True


class OffloadOptimizerConfig(ConfigModel):
    device: OffloadDevice = "none"
    nvme_path: str | None = None
    buffer_count: Int = Field(4, gt=0)
    pin_memory: bool = True
    pipeline_read: bool = False
    pipeline_write: bool = False
    fast_init: bool = False
    ratio: Float = Field(1.0, gt=0, le=1)


def _listed(value: Any) -> Any:
    return [value] if isinstance(value, str) else value


Names = Annotated[list[str], BeforeValidator(_listed)]

# DeepSpeed 0.19's defaults: the Hugging Face MoE blocks that run only the experts their tokens chose
DEFAULT_LEAF_MODULE_CLASSES = [
    "transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock",
    "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
    "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock",
]


class LeafModuleConfig(ConfigModel):
    """``zero_optimization.leaf_module`` (DeepSpeed 0.19): the modules ZeRO-3 gathers whole on entry,
    by class (name or ``module.QualName``), by module name, or by the end of the module name."""

    classes: Names = Field(default_factory=lambda: list(DEFAULT_LEAF_MODULE_CLASSES))
    names: Names = Field(default_factory=list)
    name_suffixes: Names = Field(default_factory=list)


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


class ZeroConfig(ConfigModel):
    stage: Int = Field(0, ge=0, le=3)
    contiguous_gradients: bool = True
    reduce_scatter: bool = True
    reduce_bucket_size: Int = Field(500_000_000, gt=0)
    allgather_partitions: bool = True
    allgather_bucket_size: Int = Field(500_000_000, gt=0)
    # None only until validation ends: then true for stage 3, false otherwise
    overlap_comm: bool | None = None
    load_from_fp32_weights: bool = True
    elastic_checkpoint: bool = False
    offload_param: OffloadParamConfig | None = None
    offload_optimizer: OffloadOptimizerConfig | None = None
    sub_group_size: Int = Field(1_000_000_000, gt=0)
    stage3_prefetch_bucket_size: Int = Field(50_000_000, ge=0)
    stage3_param_persistence_threshold: Int = Field(100_000, ge=0)
    stage3_model_persistence_threshold: Int = Field(sys.maxsize, ge=0)
    stage3_max_live_parameters: Int = Field(1_000_000_000, ge=0)
    stage3_max_reuse_distance: Int = Field(1_000_000_000, ge=0)
    stage3_gather_16bit_weights_on_model_save: bool = False
    ignore_unused_parameters: bool = True
    round_robin_gradients: bool = False
    zero_hpz_partition_size: Int = Field(1, ge=1)
    zero_quantized_weights: bool = False
    zero_quantized_nontrainable_weights: bool = False
    zero_quantized_gradients: bool = False
    zeropp_loco_param: dict | None = None  # LoCo error feedback of qgZ: {"err_beta": 0.8, "reset_T": 1024}
    mics_shard_size: Int = -1
    use_multi_rank_bucket_allreduce: bool = True
    memory_efficient_linear: bool = True
    leaf_module: LeafModuleConfig = Field(default_factory=LeafModuleConfig)

    renamed: ClassVar[dict[str, str]] = {
        "stage3_gather_fp16_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",
    }

    # DeepSpeed's field names for the stage3_ keys (its pydantic aliases: both spellings are current)
    field_names: ClassVar[dict[str, str]] = {
        name.removeprefix("stage3_"): name for name in (
            "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold", "stage3_model_persistence_threshold",
            "stage3_max_live_parameters", "stage3_max_reuse_distance", "stage3_gather_16bit_weights_on_model_save")}

    @classmethod
    def upgrade(cls, data: dict[str, Any], path: str, report: "Report") -> dict[str, Any]:
        data = super().upgrade(data, path, report)
        for short, name in cls.field_names.items():
            if short in data:
                if name in data:
                    report.problem(f"{_join(path, short)} and {_join(path, name)} are the same key (DeepSpeed "
                                   "alias); keep one")
                    data.pop(short)
                else:
                    data[name] = data.pop(short)
        # boolean switches of old DeepSpeed versions -> offload blocks
        for old, new in (("cpu_offload", "offload_optimizer"), ("cpu_offload_param", "offload_param")):
            if old not in data:
                continue
            value, where = data.pop(old), _join(path, old)
            if not isinstance(value, bool):
                report.problem(f"{where}: expected true or false, got {describe_value(value)}")
                continue
            report.warn(f"{where} is deprecated; use {_join(path, new)} = {{\"device\": \"cpu\"}} instead")
            if new in data:
                report.problem(f"{where} and {_join(path, new)} are both given; keep only {new}")
            elif value:
                data[new] = {"device": "cpu"}
        if "cpu_offload_use_pin_memory" in data:
            value, where = data.pop("cpu_offload_use_pin_memory"), _join(path, "cpu_offload_use_pin_memory")
            report.warn(f"{where} is deprecated; use {_join(path, 'offload_param.pin_memory')} "
                        f"and {_join(path, 'offload_optimizer.pin_memory')} instead")
            if not isinstance(value, bool):
                report.problem(f"{where}: expected true or false, got {describe_value(value)}")
            else:
                for block in ("offload_param", "offload_optimizer"):
                    if isinstance(data.get(block), dict):
                        data[block] = {"pin_memory": value, **data[block]}
        stage, block = data.get("stage", 0), data.get("offload_param")
        offloaded = isinstance(block, dict) and block.get("device") in ("cpu", "nvme")
        if isinstance(stage, int) and stage < 3 and offloaded:
            # DeepSpeed ignores it below stage 3 (DeepSpeed-Chat's --offload writes both blocks at any stage)
            # The block stays (DeepSpeed's config object keeps it too); nothing below stage 3 reads it.
            report.warn(f"{_join(path, 'offload_param')} is ignored: parameter offload needs ZeRO stage 3 "
                        f"(stage is {stage}); the parameters stay on the device")
        return data

    @model_validator(mode="after")
    def _derive_overlap_comm(self) -> "ZeroConfig":
        if self.overlap_comm is None:
            self.overlap_comm = self.stage == 3
        return self
