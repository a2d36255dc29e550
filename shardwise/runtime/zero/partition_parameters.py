"""``deepspeed.runtime.zero.partition_parameters``."""

from shardwise.zero.init import GatheredParameters, Init, register_external_parameter

__all__ = ["GatheredParameters", "Init", "register_external_parameter"]
