"""``deepspeed.profiling.flops_profiler``: shardwise's flops profiler (``shardwise.profiling``: ``FlopsProfiler``,
``get_model_profile``); DeepSpeed's package layout, with its ``profiler`` submodule."""
from shardwise.profiling.flops import FlopsProfiler
from shardwise.profiling.model_profile import get_model_profile

from . import profiler  # noqa: F401  (DeepSpeed's package imports it)

__all__ = ["FlopsProfiler", "get_model_profile"]
