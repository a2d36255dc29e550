"""ZeRO: how gradients, optimizer states and parameters are spread over data-parallel ranks."""

from shardwise.zero.flat import FlatGroup, Fragment
from shardwise.zero.strategy import ReduceSettings, StepResult, ZeroStrategy, build_strategy

__all__ = ["FlatGroup", "Fragment", "ReduceSettings", "StepResult", "ZeroStrategy", "build_strategy"]
