"""``deepspeed.runtime.pipe.topology``: see ``shardwise.topology``."""

from shardwise.topology import *  # noqa: F401,F403
from shardwise.topology import PipeDataParallelTopology, PipeModelDataParallelTopology, ProcessTopology  # noqa: F401
