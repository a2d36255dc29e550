"""``deepspeed.runtime.zero.config``: the ``zero_optimization`` block under DeepSpeed's class and field
names, validated by shardwise's model of it (``shardwise.config.zero.ZeroConfig``)."""
from __future__ import annotations

from enum import Enum

from shardwise.config.zero import ZeroConfig

from ..._config_view import ConfigView
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


__all__ = ["DeepSpeedZeroConfig", "DeepSpeedZeroOffloadOptimizerConfig", "DeepSpeedZeroOffloadParamConfig",
           "OffloadDeviceEnum", "ZeroStageEnum"]
