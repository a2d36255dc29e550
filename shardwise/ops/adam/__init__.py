"""``deepspeed.ops.adam``: DeepSpeedCPUAdam and FusedAdam; ZenFlow's selective AdamW under DeepSpeed's names
(``ZenFlowSelectiveAdamW``, ``ZenFlowSelectiveAdamW_stage3``: ``shardwise.optim.selective_adam``)."""

from shardwise.optim.selective_adam import PartitionedSelectiveAdamW as ZenFlowSelectiveAdamW_stage3
from shardwise.optim.selective_adam import SelectiveAdamW as ZenFlowSelectiveAdamW

from .cpu_adam import DeepSpeedCPUAdam
from .fused_adam import FusedAdam

__all__ = ["DeepSpeedCPUAdam", "FusedAdam", "ZenFlowSelectiveAdamW", "ZenFlowSelectiveAdamW_stage3"]
