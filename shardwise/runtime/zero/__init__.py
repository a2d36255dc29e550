"""``deepspeed.runtime.zero``: ZeRO-3 construction and gathering (``shardwise.zero``)."""

from shardwise.zero.init import GatheredParameters, Init, register_external_parameter

__all__ = ["GatheredParameters", "Init", "register_external_parameter"]
