"""``deepspeed.runtime.zero``: ZeRO-3 construction and gathering (``shardwise.zero``)."""

from shardwise.zero.init import GatheredParameters, Init, register_external_parameter
from shardwise.zero.param_offload import gathered_for_generation as unwrap_model_for_generation
from shardwise.zero.partitioned_param import ZeroParamStatus

__all__ = ["GatheredParameters", "Init", "ZeroParamStatus", "register_external_parameter",
           "unwrap_model_for_generation"]
