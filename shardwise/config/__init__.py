"""DeepSpeed-format configuration for shardwise.

>>> from shardwise.config import load_config
>>> cfg = load_config({"train_micro_batch_size_per_gpu": 4})
>>> cfg.resolve_batch_sizes(dp_world_size=2).train_batch_size
8
"""

from .batch import BatchSizes
from .errors import ConfigError
from .loader import load_config
from .model import ShardwiseConfig
from .support import NOT_IMPLEMENTED

__all__ = ["ShardwiseConfig", "ConfigError", "BatchSizes", "load_config", "NOT_IMPLEMENTED"]
