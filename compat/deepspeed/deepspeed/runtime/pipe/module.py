"""``deepspeed.runtime.pipe.module``: see ``shardwise.pipe.module``."""

from shardwise.pipe.module import *  # noqa: F401,F403
from shardwise.pipe.module import LayerSpec, PipelineModule, TiedLayerSpec  # noqa: F401
