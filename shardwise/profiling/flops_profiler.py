"""DeepSpeed's import path: ``from deepspeed.profiling.flops_profiler import get_model_profile``."""

from .flops import FlopsProfiler
from .model_profile import get_model_profile

__all__ = ["FlopsProfiler", "get_model_profile"]
