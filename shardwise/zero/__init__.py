"""ZeRO: how gradients, optimizer states and parameters are spread over data-parallel ranks."""

from shardwise.zero.factory import build_strategy
from shardwise.zero.flat import FlatGroup, Fragment
from shardwise.zero.init import GatheredParameters, Init, register_external_parameter
from shardwise.zero.partitioned_param import ZeroParamStatus, full_numel, full_shape, is_partitioned
from shardwise.zero.strategy import ReduceSettings, StepResult, ZeroStrategy

__all__ = ["FlatGroup", "Fragment", "GatheredParameters", "Init", "register_external_parameter", "ReduceSettings",
           "StepResult", "ZeroParamStatus", "ZeroStrategy", "build_strategy", "full_numel", "full_shape",
           "is_partitioned"]
