"""``deepspeed.checkpoint``: shardwise.checkpoint's names; ``constants`` and ``universal_checkpoint`` are this
package's modules (DeepSpeed's checkpoint key names and its AutoTP restore helpers), the other submodules are
shardwise's (``deepspeed.checkpoint.utils`` is ``shardwise.checkpoint.utils``)."""
import shardwise.checkpoint as _checkpoint
from shardwise.checkpoint import *  # noqa: F401,F403
from deepspeed.checkpoint.constants import *  # noqa: F401,F403 (DeepSpeed exports its key names here too)


def __getattr__(name: str):
    return getattr(_checkpoint, name)
