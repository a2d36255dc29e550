"""Checkpoints: safetensors shards + a JSON manifest, written atomically, loadable at any layout.

``engine.save_checkpoint`` / ``engine.load_checkpoint`` are the training-time entry points; the
functions here work on a checkpoint folder alone (no engine, no process group).
"""

from shardwise.checkpoint.consolidate import (
    consolidate_checkpoint,
    convert_zero_checkpoint_to_fp32_state_dict,
    get_fp32_state_dict_from_checkpoint,
    get_fp32_state_dict_from_zero_checkpoint,
    load_state_dict_from_zero_checkpoint,
)
from shardwise.checkpoint.engine_io import load_checkpoint, save_checkpoint
from shardwise.checkpoint.manifest import Checkpoint, list_tags, open_checkpoint

__all__ = [
    "Checkpoint",
    "consolidate_checkpoint",
    "convert_zero_checkpoint_to_fp32_state_dict",
    "get_fp32_state_dict_from_checkpoint",
    "get_fp32_state_dict_from_zero_checkpoint",
    "list_tags",
    "load_checkpoint",
    "load_state_dict_from_zero_checkpoint",
    "open_checkpoint",
    "save_checkpoint",
]
