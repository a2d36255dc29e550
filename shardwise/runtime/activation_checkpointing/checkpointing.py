"""``deepspeed.runtime.activation_checkpointing.checkpointing``: the same module as
``shardwise.checkpointing`` (``deepspeed.checkpointing``)."""

import sys

from shardwise import checkpointing as _checkpointing

sys.modules[__name__] = _checkpointing  # one module, one set of settings, under both paths
