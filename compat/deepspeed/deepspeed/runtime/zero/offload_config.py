"""``deepspeed.runtime.zero.offload_config``: the offload sub-blocks of ``zero_optimization``."""
from __future__ import annotations

from shardwise.config.zero import OffloadOptimizerConfig, OffloadParamConfig
from shardwise.zero.offload_states import OffloadDeviceEnum, OffloadStateTypeEnum

from ..._config_view import ConfigView


class DeepSpeedZeroOffloadParamConfig(ConfigView):
    model = OffloadParamConfig
    where = "zero_optimization.offload_param"


class DeepSpeedZeroOffloadOptimizerConfig(ConfigView):
    model = OffloadOptimizerConfig
    where = "zero_optimization.offload_optimizer"

    @property
    def pipeline(self) -> bool:
        """Whether NVMe reads or writes overlap the optimizer step."""
        return self.pipeline_read or self.pipeline_write


__all__ = ["DeepSpeedZeroOffloadOptimizerConfig", "DeepSpeedZeroOffloadParamConfig", "OffloadDeviceEnum",
           "OffloadStateTypeEnum"]
