"""Checkpoints: safetensors shards + a JSON manifest, written atomically."""

from shardwise.checkpoint.engine_io import load_checkpoint, save_checkpoint

__all__ = ["load_checkpoint", "save_checkpoint"]
