"""Seeing inside a model: flops profiler, memory estimator, peak-memory measurement.

>>> from shardwise.profiling import get_model_profile, estimate_model_states
"""

from __future__ import annotations

_LAZY = {
    "FlopsProfiler": "flops",
    "ModuleStats": "flops",
    "get_model_profile": "model_profile",
    "estimate_model_states": "estimator",
    "estimate_activations": "estimator",
    "estimate_from_model": "estimator",
    "estimate_from_hf_config": "estimator",
    "MemoryEstimate": "estimator",
    "PeakMemory": "memory",
    "LiveTensorPeak": "memory",
    "live_tensor_bytes": "memory",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'shardwise.profiling' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"shardwise.profiling.{_LAZY[name]}"), name)
