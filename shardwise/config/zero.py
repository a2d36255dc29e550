"""The ``zero_optimization`` block and its offload sub-blocks."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Annotated, Any, Callable, ClassVar, Literal

from pydantic import BeforeValidator, Field, model_validator

from .base import ConfigModel, Float, Int, is_default, not_implemented
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

    refused: ClassVar[dict[str, tuple[Callable[[Any], bool], str]]] = {
        "super_offload": (is_default(False), not_implemented(
            "SuperOffload (DeepSpeed's optimizer offload tuned for superchips such as GH200)",
            "offload_optimizer with device \"cpu\" runs the step on the host")),
        "cpuadam_cores_perc": (is_default(0.8), not_implemented(
            "the share of cores given to DeepSpeed's compiled CPU Adam",
            "the host step runs on torch's threads (torch.set_num_threads or OMP_NUM_THREADS)")),
    }


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


def _stage_of(data: dict[str, Any]) -> int | None:
    stage = data.get("stage", 0)
    if isinstance(stage, float) and stage.is_integer():
        stage = int(stage)
    return stage if isinstance(stage, int) and not isinstance(stage, bool) else None


def _refuse_zeropp_below_stage3(keys: dict[str, str], data: dict[str, Any], path: str, report: "Report") -> None:
    """ZeRO++ reworks ZeRO-3's parameter all-gather and gradient reduce-scatter: below stage 3 (where DeepSpeed
    ignores the keys) each one switched on is an error naming it."""
    stage = _stage_of(data)
    if stage is None or stage >= 3:
        return
    for key, what in keys.items():
        value = data.get(key)
        if key == "zero_hpz_partition_size":
            on = isinstance(value, (int, float)) and not isinstance(value, bool) and value > 1
        elif key == "zeropp_loco_param":
            on = value is not None and value != "auto"
        else:
            on = value is True or value == 1
        if on:
            shown = "" if key == "zeropp_loco_param" else \
                f" = {describe_value(value if key == 'zero_hpz_partition_size' else True)}"
            report.problem(f"{_join(path, key)}{shown}: ZeRO++ ({what}) works on ZeRO-3's "
                           f"partitioned parameters; it needs {_join(path, 'stage')} 3 (stage is {stage})")


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

    # Every other key of DeepSpeed 0.19.8's DeepSpeedZeroConfig: its default passes, any other value is refused
    refused: ClassVar[dict[str, tuple[Callable[[Any], bool], str]]] = {
        "zenflow": (is_default(None), not_implemented(
            "ZenFlow (stall-free offload: the important gradient columns updated on the device, the rest on the "
            "CPU in the background)", "use offload_optimizer without it")),
        "compute_grad_norm": (is_default(True), not_implemented(
            "skipping the global gradient norm at stages 1-2",
            "the norm is always computed (clipping, get_global_grad_norm()): remove the key")),
        **{key: (is_default(0), not_implemented(
            "fetching fine-grained modules as one unit",
            "ZeRO-3 gathers parameters in units cut by stage3_prefetch_bucket_size: remove the key"))
           for key in ("stage3_module_granularity_threshold", "module_granularity_threshold")},
        **{key: (is_default(False), not_implemented("fetching ZeRO-3 parameters with an all-reduce instead of an all-gather"))
           for key in ("stage3_use_all_reduce_for_fetch_params", "use_all_reduce_for_fetch_params")},
        **{key: (is_default(False), not_implemented("gathering ZeRO-3 parameters one by one without a flat bucket"))
           for key in ("stage3_allgather_sequential", "allgather_sequential")},
        "legacy_stage1": (is_default(False), not_implemented("DeepSpeed's old ZeRO stage 1", "shardwise has one stage 1: remove the key")),
        "pipeline_loading_checkpoint": (is_default(False), not_implemented("forcing ZeRO-3 checkpoints to load in pipeline mode")),
        "override_module_apply": (is_default(True), not_implemented(
            "leaving torch.nn.Module.apply alone under zero.Init",
            "zero.Init always gathers the parameters inside apply: remove the key")),
        "log_trace_cache_warnings": (is_default(False), not_implemented(
            "DeepSpeed's ZeRO-3 trace cache", "parameters are gathered by module hooks with no trace to warn "
            "about: remove the key")),
        "enable_sanity_checks": (is_default(False), not_implemented("DeepSpeed's internal ZeRO-3 sanity checks")),
        "save_muon_momentum_buffer_in_memory": (is_default(False), not_implemented(
            "Muon with NVMe optimizer offload, the only place the key matters,",
            "Muon with offload_optimizer is refused: remove the key")),
        "parameter_alignment": (is_default(False), not_implemented("padding the stage 1-2 flat buffers so each parameter starts 16-byte aligned")),
        # removed from DeepSpeed (its _REMOVED_ZERO_CONFIG_KEYS): refused there whatever the value
        "mics_shard_size": (is_default(-1), "MiCS sharding was removed from DeepSpeed (refused since 0.19.8, "
                            "https://github.com/deepspeedai/DeepSpeed/issues/8489) and is not implemented in "
                            "shardwise: remove the key (zero_hpz_partition_size keeps a node-local copy of the "
                            "ZeRO-3 parameters, the closest feature)"),
        "mics_hierarchical_params_gather": (is_default(False), "MiCS sharding was removed from DeepSpeed (refused "
                                            "since 0.19.8, https://github.com/deepspeedai/DeepSpeed/issues/8489) "
                                            "and is not implemented in shardwise: remove the key"),
    }

    # ZeRO++ (docs/zero.md): key -> what it does, for the error below stage 3
    zeropp: ClassVar[dict[str, str]] = {
        "zero_quantized_weights": "qwZ, the int8 parameter all-gather",
        "zero_quantized_nontrainable_weights": "qwZ, frozen parameters kept in int8",
        "zero_hpz_partition_size": "hpZ, a node-local secondary partition of the parameters",
        "zero_quantized_gradients": "qgZ, the quantized gradient all-to-all",
        "zeropp_loco_param": "LoCo error feedback of qgZ",
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
        _refuse_zeropp_below_stage3(cls.zeropp, data, path, report)
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
