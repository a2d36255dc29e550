"""DeepCompile's ZeRO-3 set-up helpers (``deepspeed.compile.init_z3``): the process-wide Dynamo settings
ZeRO-3 compilation needs (shared by all engines that ask, restored when the last one lets go) and the
gradient dtype a parameter's gradient is reduced in. ``init_z3`` itself builds DeepSpeed's compiled
ZeRO-3 backend, which shardwise does not have."""
from __future__ import annotations

from threading import Lock

import torch

WARMUP = 5

_MISSING = object()
_DYNAMO_CONFIG_NAMES = ("force_parameter_static_shapes", "force_nn_module_property_static_shapes")
_DYNAMO_CONFIG_OWNERS = {}  # id(dynamo config) -> {"config", "previous_values", "owner_tokens"}
_DYNAMO_CONFIG_LOCK = Lock()


def _dynamo_config():
    dynamo = getattr(torch, "_dynamo", None)
    if dynamo is None:
        try:
            import torch._dynamo as dynamo
        except ImportError:
            return None
    return getattr(dynamo, "config", None)


def _allow_dynamo_dynamic_parameter_shapes_for_z3(compile_kwargs):
    """Turn off Dynamo's static-shape forcing for parameters and module properties (ZeRO-3 parameters
    change shape when gathered) and return the callback that gives this ownership back; the settings
    return to their earlier values when the last owner has called its callback (calling it twice is
    harmless). None when torch has no such settings."""
    config = _dynamo_config()
    if config is None:
        return None
    key = id(config)
    token = object()
    with _DYNAMO_CONFIG_LOCK:
        state = _DYNAMO_CONFIG_OWNERS.get(key)
        if state is None or state["config"] is not config:
            previous = {name: getattr(config, name) for name in _DYNAMO_CONFIG_NAMES if hasattr(config, name)}
            if not previous:
                return None
            state = _DYNAMO_CONFIG_OWNERS[key] = {"config": config, "previous_values": previous,
                                                  "owner_tokens": set()}
        state["owner_tokens"].add(token)
        for name in state["previous_values"]:
            setattr(config, name, False)

    def restore():
        with _DYNAMO_CONFIG_LOCK:
            current = _DYNAMO_CONFIG_OWNERS.get(key)
            if current is None or current["config"] is not config or token not in current["owner_tokens"]:
                return
            current["owner_tokens"].discard(token)
            if current["owner_tokens"]:
                return
            for name, value in current["previous_values"].items():
                setattr(config, name, value)
            del _DYNAMO_CONFIG_OWNERS[key]

    return restore


def _resolve_expected_grad_dtype(param):
    """The dtype ``param``'s gradient accumulates in, as torch's leaf ``grad_dtype``: the parameter's
    ``grad_dtype`` when set (None: any dtype), else the parameter's dtype."""
    grad_dtype = getattr(param, "grad_dtype", _MISSING)
    return param.dtype if grad_dtype is _MISSING else grad_dtype
