"""Optimizers that exchange 1-bit compressed momentum: DeepSpeed's ``OneBitAdam``, ``ZeroOneAdam``
and ``OneBitLamb`` config types (docs/onebit.md).

They train with the engine's full-precision gradient all-reduce during warm-up and then
communicate themselves through ``shardwise.comm.compressed_all_reduce``; before each backward the
engine sets ``engine.enable_backward_allreduce`` to ``optimizer.needs_gradient_allreduce`` (see
:mod:`.engine_support`).
"""

from shardwise.optim.onebit.adam import OneBitAdam
from shardwise.optim.onebit.lamb import OneBitLamb
from shardwise.optim.onebit.zoadam import ZeroOneAdam

__all__ = ["OneBitAdam", "OneBitLamb", "ZeroOneAdam"]
