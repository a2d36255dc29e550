"""``deepspeed.launcher``: shardwise.launcher's names; ``deepspeed.launcher.runner`` is this package's module."""
import shardwise.launcher as _launcher
from shardwise.launcher import *  # noqa: F401,F403


def __getattr__(name: str):
    return getattr(_launcher, name)
