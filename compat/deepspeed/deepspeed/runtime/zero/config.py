"""``deepspeed.runtime.zero.config``: the ``zero_optimization`` block under DeepSpeed's class and field
names, validated by shardwise's model of it (``shardwise.config.zero.ZeroConfig``)."""
from __future__ import annotations

from enum import Enum

from shardwise.config.zero import ZeroConfig

from ..._config_view import ConfigView
from ..zenflow.zenflow_config import ZenFlowConfig
from .offload_config import DeepSpeedZeroOffloadOptimizerConfig, DeepSpeedZeroOffloadParamConfig, OffloadDeviceEnum


class ZeroStageEnum(int, Enum):
    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3
    max_stage = 3


class DeepSpeedZeroConfig(ConfigView):
    model = ZeroConfig
    where = "zero_optimization"
    # DeepSpeed's field names of the stage-3 keys (the config's "stage3_*" keys are its aliases)
    names = {
        "prefetch_bucket_size": "stage3_prefetch_bucket_size",
        "param_persistence_threshold": "stage3_param_persistence_threshold",
        "model_persistence_threshold": "stage3_model_persistence_threshold",
        "max_live_parameters": "stage3_max_live_parameters",
        "max_reuse_distance": "stage3_max_reuse_distance",
        "gather_16bit_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",
    }
    views = {"offload_param": DeepSpeedZeroOffloadParamConfig,
             "offload_optimizer": DeepSpeedZeroOffloadOptimizerConfig}

    # a key shardwise does not take; its default (off) is what shardwise does
    pipeline_loading_checkpoint = False

    def __init__(self, **data) -> None:
        # ZenFlow's block parses as DeepSpeed's (ZenFlowConfig); shardwise's engine refuses to run it, so it
        # stays out of the block shardwise validates
        zenflow = data.pop("zenflow", None)
        super().__init__(**data)
        if zenflow is not None and not isinstance(zenflow, ZenFlowConfig):
            zenflow = ZenFlowConfig(**zenflow) if isinstance(zenflow, dict) else ZenFlowConfig.model_validate(zenflow)
        object.__setattr__(self, "_zenflow", zenflow)

    @property
    def zenflow(self) -> ZenFlowConfig | None:
        return self.__dict__.get("_zenflow")


__all__ = ["DeepSpeedZeroConfig", "DeepSpeedZeroOffloadOptimizerConfig", "DeepSpeedZeroOffloadParamConfig",
           "OffloadDeviceEnum", "ZeroStageEnum"]
