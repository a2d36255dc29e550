"""Tensor parallelism: AutoTP for Hugging Face models (``autotp``)."""

from shardwise.tensor_parallel.autotp import AutoTP, autotp_hook, shard_model, tp_model_init  # noqa: F401
