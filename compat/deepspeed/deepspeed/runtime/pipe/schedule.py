"""``deepspeed.runtime.pipe.schedule``: see ``shardwise.pipe.schedule``."""

from shardwise.pipe.schedule import *  # noqa: F401,F403
