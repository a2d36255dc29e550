"""Optimizers that exchange 1-bit compressed momentum: DeepSpeed's ``OneBitAdam``, ``ZeroOneAdam``
and ``OneBitLamb`` config types (docs/onebit.md).

They train with the full-precision gradient all-reduce during warm-up and then communicate
themselves through ``shardwise.comm.compressed_all_reduce``; the ZeRO factory gives them a
compressed variant of stage 0 or 1 (``shardwise/zero/compressed.py``), which asks
``optimizer.needs_gradient_allreduce`` before each backward.
"""

from shardwise.optim.onebit.adam import OneBitAdam
from shardwise.optim.onebit.lamb import OneBitLamb
from shardwise.optim.onebit.zoadam import ZeroOneAdam

__all__ = ["OneBitAdam", "OneBitLamb", "ZeroOneAdam"]
