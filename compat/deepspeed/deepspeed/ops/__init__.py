"""``deepspeed.ops``: shardwise.ops' optimizers (``deepspeed.ops.adam`` is ``shardwise.ops.adam``, ...), and
DeepSpeed's table of which ops can be used (``__compatible_ops__``; nothing is compiled or installed)."""
import shardwise.ops as _ops
from shardwise.ops import *  # noqa: F401,F403

from .op_builder import ALL_OPS as _ALL_OPS

__compatible_ops__ = {name: builder.is_compatible() for name, builder in _ALL_OPS.items()}
__installed_ops__ = dict.fromkeys(_ALL_OPS, False)


def __getattr__(name: str):
    return getattr(_ops, name)
