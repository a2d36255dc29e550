"""``deepspeed.utils.pin_memory``: the switch to DeepSpeed's native (DeepNVMe ``mlock``) host pinning.

``DS_PIN_MEMORY_BACKEND=native`` selects it in DeepSpeed; it needs the compiled ``pin_memory`` op, and
shardwise compiles no ops (``deepspeed.ops.op_builder.PinMemoryBuilder().load()`` raises), so selecting it
fails early with DeepSpeed's ``RuntimeError`` rather than quietly pinning with torch. Without the variable
(or with ``torch``) the accelerator pins with torch, as in DeepSpeed."""
from __future__ import annotations

import os

__all__ = ["NativePinnedMemory", "get_active_native_pinned_memory", "get_native_pinned_memory"]


class NativePinnedMemory:
    """DeepSpeed's native pinned-memory manager: only its construction, which needs the ``pin_memory`` op."""

    def __init__(self):
        try:
            from deepspeed.ops.op_builder import PinMemoryBuilder

            self._handle = PinMemoryBuilder().load().pin_handle()
        except Exception as e:  # noqa: BLE001 -- DeepSpeed wraps any build/load failure
            raise RuntimeError(
                "DS_PIN_MEMORY_BACKEND=native requires the pin_memory op, which failed to build/load.") from e


_shared_native_pins = None


def get_native_pinned_memory() -> NativePinnedMemory:
    global _shared_native_pins
    if _shared_native_pins is None:
        _shared_native_pins = NativePinnedMemory()
    return _shared_native_pins


def get_active_native_pinned_memory():
    """The native manager when ``DS_PIN_MEMORY_BACKEND=native`` (raising when it cannot be built), else None."""
    if os.environ.get("DS_PIN_MEMORY_BACKEND", "torch").strip().lower() != "native":
        return None
    return get_native_pinned_memory()
