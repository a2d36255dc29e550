"""``deepspeed.runtime.hybrid_engine``: ``DeepSpeedHybridEngine`` is shardwise's ``HybridEngine``
(``shardwise.runtime.hybrid_engine``) with DeepSpeed's private engine helpers (``deepspeed.runtime.engine``);
``deepspeed.initialize`` builds it when ``hybrid_engine.enabled`` is set."""

import shardwise.runtime.hybrid_engine as _hybrid
from shardwise.runtime.hybrid_engine import HybridEngine

from deepspeed.runtime.engine import DeepSpeedEngine


def __getattr__(name: str):
    return getattr(_hybrid, name)


class DeepSpeedHybridEngine(DeepSpeedEngine, HybridEngine):
    """shardwise's ``HybridEngine`` under DeepSpeed's name, with DeepSpeed's private helpers."""
