"""DeepSpeed's ``deepspeed.ops`` optimizers under the same module paths.

``shardwise.ops.adam.DeepSpeedCPUAdam``, ``FusedAdam``, ``shardwise.ops.lamb.FusedLamb``,
``shardwise.ops.adagrad.DeepSpeedCPUAdagrad``, ``shardwise.ops.lion.DeepSpeedCPULion`` and
``FusedLion`` take DeepSpeed 0.19's constructor arguments.  Nothing is compiled: they run
torch's fused kernels (CPU and CUDA) where torch has them and the chunked updates of
``shardwise.optim.chunked`` elsewhere, the same paths as the optimizers built from the
config.  They are ordinary ``torch.optim.Optimizer`` objects, so the engine takes them as
client optimizers at every ZeRO stage and with offload.
"""

from . import adagrad, adam, lamb, lion

__all__ = ["adagrad", "adam", "lamb", "lion"]
