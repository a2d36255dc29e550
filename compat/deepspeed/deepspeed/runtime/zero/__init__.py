"""``deepspeed.runtime.zero``: ZeRO-3 construction and gathering (``shardwise.zero``; ``GatheredParameters`` is
``partition_parameters``' own, which also gathers DeepSpeed's self-gathering parameters)."""

from shardwise.zero.init import Init, register_external_parameter
from shardwise.zero.param_offload import gathered_for_generation as unwrap_model_for_generation
from shardwise.zero.partitioned_param import ZeroParamStatus

from .partition_parameters import GatheredParameters

__all__ = ["GatheredParameters", "Init", "ZeroParamStatus", "register_external_parameter",
           "unwrap_model_for_generation"]
