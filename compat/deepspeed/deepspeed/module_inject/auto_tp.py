"""``deepspeed.module_inject.auto_tp``: AutoTP (shardwise.tensor_parallel.autotp)."""

from shardwise.tensor_parallel.autotp import AutoTP  # noqa: F401

__all__ = ["AutoTP"]
