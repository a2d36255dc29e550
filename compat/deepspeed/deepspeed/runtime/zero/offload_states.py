"""``deepspeed.runtime.zero.offload_states``: the state names and where a state lives now
(``engine.offload_states()`` / ``reload_states()``: shardwise/zero/offload_states.py)."""
from __future__ import annotations

from shardwise.zero.offload_states import OffloadStateTypeEnum, get_state_devices

__all__ = ["OffloadStateTypeEnum", "get_state_devices"]
