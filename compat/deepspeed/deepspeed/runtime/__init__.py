"""``deepspeed.runtime``: shardwise.runtime's names; the submodules resolve through the compat finder
(this package's own files first, then ``shardwise.runtime.*``)."""
import shardwise.runtime as _runtime
from shardwise.runtime import *  # noqa: F401,F403


def __getattr__(name: str):
    return getattr(_runtime, name)
