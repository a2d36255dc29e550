"""``deepspeed.profiling.flops_profiler.profiler``: where DeepSpeed defines ``FlopsProfiler`` and
``get_model_profile``; shardwise's (``shardwise.profiling``)."""
from shardwise.profiling.flops import FlopsProfiler  # noqa: F401
from shardwise.profiling.model_profile import get_model_profile  # noqa: F401
