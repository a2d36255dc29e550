"""``deepspeed.profiling.flops_profiler.profiler``: where DeepSpeed defines ``FlopsProfiler`` and
``get_model_profile``; shardwise's (``shardwise.profiling``)."""
from shardwise.profiling.flops_profiler import FlopsProfiler, get_model_profile  # noqa: F401
