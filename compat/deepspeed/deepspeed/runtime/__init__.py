"""``deepspeed.runtime``: shardwise.runtime's names; the submodules resolve through the compat finder
(this package's own files first, then ``shardwise.runtime.*``)."""
from shardwise.runtime import *  # noqa: F401,F403
from shardwise.runtime import __all__  # noqa: F401
