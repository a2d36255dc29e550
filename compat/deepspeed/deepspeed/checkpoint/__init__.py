"""``deepspeed.checkpoint``: shardwise.checkpoint's names; ``constants``, ``utils`` and ``universal_checkpoint`` are
this package's modules (DeepSpeed's checkpoint key names and file names, its AutoTP restore helpers), the other
submodules are shardwise's."""
import shardwise.checkpoint as _checkpoint
from shardwise.checkpoint import *  # noqa: F401,F403
from deepspeed.checkpoint.constants import *  # noqa: F401,F403 (DeepSpeed exports its key names here too)


def __getattr__(name: str):
    return getattr(_checkpoint, name)
