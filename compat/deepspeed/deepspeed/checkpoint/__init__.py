"""``deepspeed.checkpoint``: shardwise.checkpoint's names; ``constants``, ``utils``, ``universal_checkpoint`` and
DeepSpeed's folder readers (``reshape_utils``, ``reshape_meg_2d``, ``reshape_3d_utils``, ``zero_checkpoint``,
``deepspeed_checkpoint``: ``DeepSpeedCheckpoint``, ``ZeROCheckpoint``, ``model_3d_desc``,
``get_model_3d_descriptor``) are this package's modules (DeepSpeed's checkpoint key and file names, its AutoTP
restore helpers, its checkpoint-folder layout), the other submodules are shardwise's."""
import shardwise.checkpoint as _checkpoint
from shardwise.checkpoint import *  # noqa: F401,F403
from deepspeed.checkpoint.constants import *  # noqa: F401,F403 (DeepSpeed exports its key names here too)
from deepspeed.checkpoint.deepspeed_checkpoint import DeepSpeedCheckpoint  # noqa: F401,E402
from deepspeed.checkpoint.reshape_3d_utils import get_model_3d_descriptor, model_3d_desc  # noqa: F401,E402
from deepspeed.checkpoint.reshape_meg_2d import reshape_meg_2d_parallel  # noqa: F401,E402
from deepspeed.checkpoint.reshape_utils import merge_state  # noqa: F401,E402
from deepspeed.checkpoint.zero_checkpoint import ZeROCheckpoint  # noqa: F401,E402


def __getattr__(name: str):
    return getattr(_checkpoint, name)
