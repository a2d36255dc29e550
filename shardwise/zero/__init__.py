"""ZeRO: how gradients, optimizer states and parameters are spread over data-parallel ranks."""

from shardwise.zero.flat import FlatGroup, Fragment
from shardwise.zero.init import GatheredParameters, Init, register_external_parameter
from shardwise.zero.strategy import ReduceSettings, StepResult, ZeroStrategy, build_strategy

__all__ = ["FlatGroup", "Fragment", "GatheredParameters", "Init", "register_external_parameter", "ReduceSettings", "StepResult", "ZeroStrategy", "build_strategy"]
