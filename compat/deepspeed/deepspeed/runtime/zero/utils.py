"""``deepspeed.runtime.zero.utils``: the exception class DeepSpeed's ZeRO raises for unsupported setups."""


class ZeRORuntimeException(Exception):
    """DeepSpeed's error for a ZeRO setup it refuses at initialize (for example a client optimizer
    with ``zero_force_ds_cpu_optimizer`` and offload). shardwise raises ``ValueError`` for these."""


__all__ = ["ZeRORuntimeException"]
