"""``deepspeed.runtime.data_pipeline.curriculum_scheduler``: ``CurriculumScheduler`` is
shardwise.data.curriculum.CurriculumSchedule (fixed_linear / fixed_root / fixed_discrete / custom,
DeepSpeed's difficulty per step)."""
from shardwise.data.curriculum import CurriculumSchedule as CurriculumScheduler

from .constants import *  # noqa: F401,F403  (DeepSpeed's module star-imports its constants)

__all__ = ["CurriculumScheduler"]
