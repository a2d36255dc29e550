"""``deepspeed.runtime.pipe.engine``: see ``shardwise.pipe.engine``."""

from shardwise.pipe.engine import PipelineEngine  # noqa: F401
