"""``deepspeed.utils``: shardwise.utils' names; ``numa`` and ``torch`` are this package's modules, the other
submodules are shardwise's (``deepspeed.utils.groups`` is ``shardwise.utils.groups``)."""
import shardwise.utils as _utils
from shardwise.utils import *  # noqa: F401,F403


def __getattr__(name: str):
    return getattr(_utils, name)
