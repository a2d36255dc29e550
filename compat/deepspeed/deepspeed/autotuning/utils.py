"""``deepspeed.autotuning.utils``: DeepSpeed's config helpers of the autotuner that scripts and tests call
(``get_val_by_key`` is the nested lookup shardwise's trial runner maps ``arg_mappings`` with,
``shardwise.autotuning.runner.config_value``); the rest of the module is the autotuner's own machinery,
which ``shardwise autotune`` replaces."""
from __future__ import annotations

from shardwise.autotuning.runner import config_value

__all__ = ["get_val_by_key", "set_val_by_key"]


def get_val_by_key(d: dict, k):
    """The value of ``k`` in ``d`` or in any dict nested in it (depth first); None when absent."""
    return config_value(d, k)


def set_val_by_key(d: dict, k, vv) -> None:
    """Set ``k`` to ``vv`` wherever it occurs in ``d`` and the dicts nested in it."""
    if k in d:
        d[k] = vv
    for v in d.values():
        if isinstance(v, dict):
            set_val_by_key(v, k, vv)
