"""``deepspeed.runtime.zero.utils``: the exception class DeepSpeed's ZeRO raises for setups it refuses at
initialize. It is shardwise's ``ZeroSetupError`` (a ``ValueError``), so either name catches it."""
from shardwise.runtime.engine_compat import ZeroSetupError as ZeRORuntimeException

__all__ = ["ZeRORuntimeException"]
