"""``deepspeed.runtime.pipe.engine``: ``PipelineEngine`` is shardwise's pipeline engine
(``shardwise.pipe.engine.PipelineEngine``) with DeepSpeed's private engine helpers
(``deepspeed.runtime.engine``); ``deepspeed.initialize`` builds it for a ``PipelineModule``."""

import shardwise.pipe.engine as _engine
from shardwise.pipe.engine import PipelineEngine as _PipelineEngine

from deepspeed.runtime.engine import DeepSpeedEngine


def __getattr__(name: str):
    return getattr(_engine, name)


class PipelineEngine(DeepSpeedEngine, _PipelineEngine):
    """shardwise's ``PipelineEngine`` under DeepSpeed's name, with DeepSpeed's private helpers."""
