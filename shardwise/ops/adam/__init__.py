"""``deepspeed.ops.adam``: DeepSpeedCPUAdam and FusedAdam; ZenFlow's selective AdamW under DeepSpeed's class
names (``ZenFlowSelectiveAdamW``, ``ZenFlowSelectiveAdamW_stage3``: ``shardwise.optim.selective_adam``)."""

from shardwise.optim.selective_adam import PartitionedSelectiveAdamW, SelectiveAdamW

from .cpu_adam import DeepSpeedCPUAdam
from .fused_adam import FusedAdam

__all__ = ["DeepSpeedCPUAdam", "FusedAdam", "ZenFlowSelectiveAdamW", "ZenFlowSelectiveAdamW_stage3"]


class ZenFlowSelectiveAdamW(SelectiveAdamW):
    """DeepSpeed's name of ``shardwise.optim.selective_adam.SelectiveAdamW``."""


class ZenFlowSelectiveAdamW_stage3(PartitionedSelectiveAdamW):  # noqa: N801 (DeepSpeed's name)
    """DeepSpeed's name of ``shardwise.optim.selective_adam.PartitionedSelectiveAdamW`` (ZeRO-3 partitions)."""
