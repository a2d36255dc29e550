"""``deepspeed.utils``: shardwise.utils' names; ``groups`` (views of the active grid's process groups),
``numa``, ``torch`` and ``z3_leaf_module`` are this package's modules, the other submodules are shardwise's."""
import shardwise.utils as _utils
from shardwise.utils import *  # noqa: F401,F403


def __getattr__(name: str):
    return getattr(_utils, name)

# DeepSpeed's utils/__init__ binds z3_leaf_module to the function after importing the submodule of that name
from . import z3_leaf_module as _z3_leaf_module_file  # noqa: E402,F401
from .z3_leaf_module import (set_z3_leaf_modules_by_name, set_z3_leaf_modules_by_suffix,  # noqa: E402,F401
                             z3_leaf_module)
