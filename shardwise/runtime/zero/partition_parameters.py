"""``deepspeed.runtime.zero.partition_parameters``."""

from shardwise.zero.init import GatheredParameters, Init, register_external_parameter
from shardwise.zero.partitioned_param import ZeroParamStatus

__all__ = ["GatheredParameters", "Init", "ZeroParamStatus", "register_external_parameter"]
