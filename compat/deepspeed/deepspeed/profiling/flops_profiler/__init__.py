"""``deepspeed.profiling.flops_profiler``: shardwise's flops profiler (``shardwise.profiling.flops_profiler``:
``FlopsProfiler``, ``get_model_profile``); DeepSpeed's package layout, with its ``profiler`` submodule."""
from shardwise.profiling.flops_profiler import *  # noqa: F401,F403
from shardwise.profiling.flops_profiler import FlopsProfiler, get_model_profile  # noqa: F401

from . import profiler  # noqa: F401  (DeepSpeed's package imports it)
