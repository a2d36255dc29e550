"""``deepspeed.utils.timer``: DeepSpeed's timer names onto shardwise's timers.

``SynchronizedWallClockTimer`` is shardwise.utils.wall_clock.TimerGroup (named timers with
``start``/``stop``/``elapsed``/``mean``, ``log``, ``get_mean``, ``get_timers``), ``NoopTimer`` its
timing-nothing twin, ``ThroughputTimer`` the engine's samples-per-second timer
(shardwise.runtime.engine_compat), and the timer-name constants the engine's breakdown uses.
"""
from __future__ import annotations

from shardwise.runtime.engine_compat import ThroughputTimer  # noqa: F401
from shardwise.utils.wall_clock import NullTimerGroup as NoopTimer  # noqa: F401
from shardwise.utils.wall_clock import TimerGroup as SynchronizedWallClockTimer  # noqa: F401
from shardwise.utils.wall_clock import trimmed_mean as trim_mean  # noqa: F401

FORWARD_MICRO_TIMER = "fwd_microstep"
FORWARD_GLOBAL_TIMER = "fwd"
BACKWARD_MICRO_TIMER = "bwd_microstep"
BACKWARD_GLOBAL_TIMER = "bwd"
BACKWARD_INNER_MICRO_TIMER = "bwd_inner_microstep"
BACKWARD_INNER_GLOBAL_TIMER = "bwd_inner"
BACKWARD_REDUCE_MICRO_TIMER = "bwd_allreduce_microstep"
BACKWARD_REDUCE_GLOBAL_TIMER = "bwd_allreduce"
STEP_MICRO_TIMER = "step_microstep"
STEP_GLOBAL_TIMER = "step"
TIME_EPSILON = 1e-6

__all__ = ["SynchronizedWallClockTimer", "NoopTimer", "ThroughputTimer", "trim_mean", "FORWARD_MICRO_TIMER",
           "FORWARD_GLOBAL_TIMER", "BACKWARD_MICRO_TIMER", "BACKWARD_GLOBAL_TIMER", "BACKWARD_INNER_MICRO_TIMER",
           "BACKWARD_INNER_GLOBAL_TIMER", "BACKWARD_REDUCE_MICRO_TIMER", "BACKWARD_REDUCE_GLOBAL_TIMER",
           "STEP_MICRO_TIMER", "STEP_GLOBAL_TIMER", "TIME_EPSILON"]
