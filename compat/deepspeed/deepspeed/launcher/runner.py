"""``deepspeed.launcher.runner``: the names other tools take from DeepSpeed's launcher module.

accelerate's ``accelerate launch --use_deepspeed`` reads ``DEEPSPEED_ENVIRONMENT_NAME`` (the file of
``KEY=VALUE`` lines exported to every node, which ``shardwise run`` reads too); ``main`` is the
``deepspeed`` command, here ``shardwise run``.
"""
from __future__ import annotations

from shardwise.launcher.environment import ENV_FILE_NAMES

DEEPSPEED_ENVIRONMENT_NAME = ENV_FILE_NAMES[0]  # ".deepspeed_env"


def main(args=None) -> int:
    """``deepspeed ARGS``: ``shardwise run ARGS``."""
    from shardwise.cli import deepspeed_command

    return deepspeed_command(args)
