"""``deepspeed.runtime.lr_schedules``: the schedules (``shardwise.optim``) under DeepSpeed's path,
with its schedule-name constants."""

from shardwise.optim.lr_schedules import LRRangeTest, WarmupCosineLR, WarmupDecayLR, WarmupLR
from shardwise.optim.one_cycle import OneCycle

LR_RANGE_TEST = "LRRangeTest"
ONE_CYCLE = "OneCycle"
WARMUP_LR = "WarmupLR"
WARMUP_DECAY_LR = "WarmupDecayLR"
WARMUP_COSINE_LR = "WarmupCosineLR"
VALID_LR_SCHEDULES = [LR_RANGE_TEST, ONE_CYCLE, WARMUP_LR, WARMUP_DECAY_LR, WARMUP_COSINE_LR]

WARMUP_LOG_RATE = "log"
WARMUP_LINEAR_RATE = "linear"

__all__ = ["LRRangeTest", "OneCycle", "VALID_LR_SCHEDULES", "WarmupCosineLR", "WarmupDecayLR", "WarmupLR"]
