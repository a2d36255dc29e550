"""Optimizers and learning-rate schedules named in the DeepSpeed config.

``build_optimizer`` / ``build_scheduler`` turn the ``optimizer`` and ``scheduler``
config blocks into objects; the classes can also be used directly.
"""

from .factory import build_optimizer, build_scheduler
from .lamb import Lamb
from .lion import Lion
from .lr_schedules import LRRangeTest, ScheduleParamError, WarmupCosineLR, WarmupDecayLR, WarmupLR
from .one_cycle import OneCycle

__all__ = [
    "build_optimizer",
    "build_scheduler",
    "Lamb",
    "Lion",
    "LRRangeTest",
    "OneCycle",
    "ScheduleParamError",
    "WarmupCosineLR",
    "WarmupDecayLR",
    "WarmupLR",
]
