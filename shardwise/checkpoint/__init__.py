"""Checkpoints: safetensors shards + a JSON manifest, written atomically, loadable at any layout.

``engine.save_checkpoint`` / ``engine.load_checkpoint`` are the training-time entry points
(``save_checkpoint`` in ``engine_io.py``, one path for every layout; ``load_checkpoint`` in
``loading.py``, above the native reader and the DeepSpeed importer); the other functions here work on
a checkpoint folder alone (no engine, no process group).
"""

from shardwise.checkpoint.consolidate import (
    consolidate_checkpoint,
    convert_zero_checkpoint_to_fp32_state_dict,
    get_fp32_state_dict_from_checkpoint,
    get_fp32_state_dict_from_zero_checkpoint,
    load_state_dict_from_zero_checkpoint,
)
from shardwise.checkpoint.agreement import LoadFailed
from shardwise.checkpoint.engine_io import save_checkpoint
from shardwise.checkpoint.loading import load_checkpoint
from shardwise.checkpoint.manifest import Checkpoint, list_tags, open_checkpoint
from shardwise.checkpoint.module_weights import WeightsSource
from shardwise.checkpoint.writer import SaveFailed

__all__ = [
    "Checkpoint",
    "LoadFailed",
    "SaveFailed",
    "WeightsSource",
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
