"""``deepspeed.utils``: logging helpers, whole-tensor access under ZeRO, ZeRO-3 leaf modules,
``RepeatingLoader`` and (as a submodule) ``zero_to_fp32``."""

from shardwise.utils.init_on_device import OnDevice
from shardwise.utils.logging import log_dist, log_dist_once, logger, print_json_dist, set_log_level_from_string
from shardwise.utils.local_state import (
    safe_get_local_fp32_param,
    safe_get_local_grad,
    safe_get_local_optimizer_state,
    safe_set_local_fp32_param,
    safe_set_local_grad,
    safe_set_local_optimizer_state,
)
from shardwise.utils.set_full import (
    safe_set_full_fp32_param,
    safe_set_full_grad,
    safe_set_full_optimizer_state,
    safe_update_full_grad_vectorized,
)
from shardwise.utils.tensor_fragment import safe_get_full_fp32_param, safe_get_full_grad, safe_get_full_optimizer_state
from shardwise.utils.z3_leaf_module import (
    get_z3_leaf_modules,
    set_z3_leaf_module,
    set_z3_leaf_modules,
    unset_z3_leaf_modules,
    z3_leaf_module,
    z3_leaf_parameter,
)


def __getattr__(name: str):
    if name == "RepeatingLoader":  # deepspeed.utils.RepeatingLoader; the runtime imports the engine's packages lazily
        from shardwise.runtime.dataloader import RepeatingLoader

        return RepeatingLoader
    raise AttributeError(f"module 'shardwise.utils' has no attribute {name!r}")


__all__ = [
    "OnDevice",
    "RepeatingLoader",
    "get_z3_leaf_modules",
    "log_dist",
    "log_dist_once",
    "logger",
    "print_json_dist",
    "safe_get_full_fp32_param",
    "safe_get_full_grad",
    "safe_get_full_optimizer_state",
    "safe_get_local_fp32_param",
    "safe_get_local_grad",
    "safe_get_local_optimizer_state",
    "safe_set_full_fp32_param",
    "safe_set_full_grad",
    "safe_set_full_optimizer_state",
    "safe_set_local_fp32_param",
    "safe_set_local_grad",
    "safe_set_local_optimizer_state",
    "safe_update_full_grad_vectorized",
    "set_log_level_from_string",
    "set_z3_leaf_module",
    "set_z3_leaf_modules",
    "unset_z3_leaf_modules",
    "z3_leaf_module",
    "z3_leaf_parameter",
]
