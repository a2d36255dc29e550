"""``deepspeed.runtime.pipe.engine``: ``PipelineEngine`` is shardwise's pipeline engine
(``shardwise.pipe.engine.PipelineEngine``) with DeepSpeed's private engine helpers
(``deepspeed.runtime.engine``); ``deepspeed.initialize`` builds it for a ``PipelineModule``."""

import shardwise.pipe.engine as _engine
from shardwise.pipe.engine import PipelineEngine as _PipelineEngine

from deepspeed.runtime.engine import DeepSpeedEngine, _DeepSpeedInternals


def __getattr__(name: str):
    return getattr(_engine, name)


class PipelineEngine(_DeepSpeedInternals, _PipelineEngine):
    """shardwise's ``PipelineEngine`` under DeepSpeed's name, with DeepSpeed's private helpers. shardwise's
    pipeline engine is the plain engine's sibling, not its subclass; DeepSpeed's is a ``DeepSpeedEngine``
    to ``isinstance``/``issubclass`` checks, so it is registered as one (``abc``)."""


DeepSpeedEngine.register(PipelineEngine)
