"""``deepspeed.ops.adam``: DeepSpeedCPUAdam and FusedAdam."""

from .cpu_adam import DeepSpeedCPUAdam
from .fused_adam import FusedAdam

__all__ = ["DeepSpeedCPUAdam", "FusedAdam"]
