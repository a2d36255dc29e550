"""``deepspeed.utils.zero_to_fp32``: shardwise's consolidation of a checkpoint into fp32 weights
(``shardwise.utils.zero_to_fp32``: the same functions and command line), plus DeepSpeed's helpers that list
the files of DeepSpeed's own checkpoint layout (``*_optim_states.pt``, ``*_model_states.pt``) in a folder,
in human order (``zero_2_...`` before ``zero_10_...``). shardwise writes safetensors shards with a manifest,
so these helpers find files only in a folder DeepSpeed wrote.
"""
from __future__ import annotations

import glob
import os
import re

from shardwise.utils.zero_to_fp32 import *  # noqa: F401,F403
from shardwise.utils.zero_to_fp32 import main


def atoi(text: str):
    return int(text) if text.isdigit() else text


def natural_keys(text: str) -> list:
    """Sort key that orders the numbers inside names by value: ``sorted(names, key=natural_keys)``."""
    return [atoi(part) for part in re.split(r"(\d+)", text)]


def get_checkpoint_files(checkpoint_dir, glob_pattern: str) -> list[str]:
    """The files of ``checkpoint_dir`` matching ``glob_pattern``, in human order; none is an error."""
    files = sorted(glob.glob(os.path.join(checkpoint_dir, glob_pattern)), key=natural_keys)
    if not files:
        raise FileNotFoundError(f"no files matching {glob_pattern!r} in '{checkpoint_dir}' "
                                "(DeepSpeed's checkpoint layout; a shardwise checkpoint holds safetensors shards)")
    return files


def get_optim_files(checkpoint_dir) -> list[str]:
    """The ``*_optim_states.pt`` files (one per data-parallel rank) of a DeepSpeed checkpoint folder."""
    return get_checkpoint_files(checkpoint_dir, "*_optim_states.pt")


def get_model_state_files(checkpoint_dir) -> list[str]:
    """The ``*_model_states.pt`` files of a DeepSpeed checkpoint folder."""
    return get_checkpoint_files(checkpoint_dir, "*_model_states.pt")


if __name__ == "__main__":
    main()
