"""``deepspeed.runtime.zero``, which is also ``deepspeed.zero``: ZeRO-3 construction and gathering
(``shardwise.zero``; ``Init`` and ``GatheredParameters`` are ``partition_parameters``' own: shardwise's with
DeepSpeed's memory-efficient linear, and gathering DeepSpeed's self-gathering parameters too)."""

from shardwise.zero.init import register_external_parameter
from shardwise.zero.param_offload import gathered_for_generation as unwrap_model_for_generation
from shardwise.zero.partitioned_param import ZeroParamStatus

from .partition_parameters import GatheredParameters, Init

__all__ = ["GatheredParameters", "Init", "ZeroParamStatus", "register_external_parameter",
           "unwrap_model_for_generation"]
