"""Curriculum learning schedules: the difficulty (e.g. sequence length) to train at, per step.

A schedule is configured as DeepSpeed configures it (``min_difficulty``, ``max_difficulty``,
``schedule_type``, ``schedule_config``) and gives DeepSpeed's difficulty at every step:

* ``fixed_linear``: ``min + (max - min) * step / total_curriculum_step``, floored, then rounded down
  to a multiple of ``difficulty_step`` (never below the first multiple at or above ``min``, never
  above ``max``);
* ``fixed_root``: the same with ``(step / total_curriculum_step) ** (1 / root_degree)``;
* ``fixed_discrete``: ``difficulty[i]`` while ``step <= max_step[i]``, the last difficulty after;
* ``custom``: whatever function ``set_custom_get_difficulty`` installed returns.

``update_difficulty(step)`` moves the current difficulty (it stops moving once it reaches
``max_difficulty``) and returns it.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Callable

__all__ = ["CurriculumSchedule", "SCHEDULE_TYPES"]

logger = logging.getLogger("shardwise")

SCHEDULE_TYPES = ("fixed_linear", "fixed_root", "fixed_discrete", "custom")
_NEEDS = {
    "fixed_linear": ("total_curriculum_step", "difficulty_step"),
    "fixed_root": ("total_curriculum_step", "difficulty_step", "root_degree"),
    "fixed_discrete": ("difficulty", "max_step"),
    "custom": (),
}


class CurriculumSchedule:
    """One curriculum schedule. ``config`` is DeepSpeed's curriculum block (a dict); ``where`` names it
    in error messages (e.g. the config key it came from)."""

    def __init__(self, config: dict[str, Any], where: str = "curriculum_learning") -> None:
        if not isinstance(config, dict):
            raise ValueError(f"{where}: expected a dict, got {type(config).__name__}")
        for key in ("min_difficulty", "max_difficulty", "schedule_type"):
            if key not in config:
                raise ValueError(f"{where}: curriculum learning needs '{key}'")
        kind = config["schedule_type"]
        if kind not in SCHEDULE_TYPES:
            raise ValueError(f"{where}.schedule_type: {kind!r} is not one of {', '.join(SCHEDULE_TYPES)}")
        schedule = config.get("schedule_config", {}) if kind == "custom" else config.get("schedule_config")
        if not isinstance(schedule, dict):
            raise ValueError(f"{where}.schedule_config: the {kind} schedule needs a schedule_config dict")
        for key in _NEEDS[kind]:
            if key not in schedule:
                raise ValueError(f"{where}.schedule_config: the {kind} schedule needs '{key}'")
        if kind == "fixed_discrete":
            levels, ends = schedule["difficulty"], schedule["max_step"]
            if not levels or not ends or len(levels) != len(ends) + 1:
                raise ValueError(f"{where}.schedule_config: fixed_discrete needs non-empty 'difficulty' with one "
                                 f"more entry than 'max_step' (got {len(levels)} and {len(ends)})")
        if kind in ("fixed_linear", "fixed_root"):
            if schedule["difficulty_step"] <= 0 or schedule["total_curriculum_step"] <= 0:
                raise ValueError(f"{where}.schedule_config: difficulty_step and total_curriculum_step must be > 0")
            if schedule["difficulty_step"] % 8 != 0:
                logger.warning("%s: difficulty_step %s is not a multiple of 8; with the seqlen metric, tensor "
                               "cores want multiples of 8 (FP16) or 16 (INT8)", where, schedule["difficulty_step"])
        self.state: dict[str, Any] = {
            "min_difficulty": config["min_difficulty"],
            "max_difficulty": config["max_difficulty"],
            "current_difficulty": config["min_difficulty"],
            "schedule_type": kind,
        }
        if kind != "custom":
            self.state["schedule_config"] = schedule
        self.custom_get_difficulty: Callable[[int], Any] | None = None

    # -- the schedule ---------------------------------------------------------------------------------
    def set_custom_get_difficulty(self, schedule_function: Callable[[int], Any]) -> None:
        self.custom_get_difficulty = schedule_function

    def _rooted(self, step: int, degree: float) -> int:
        s = self.state["schedule_config"]
        lo, hi, quantum = self.state["min_difficulty"], self.state["max_difficulty"], s["difficulty_step"]
        value = math.floor((float(step) / s["total_curriculum_step"]) ** (1.0 / degree) * (hi - lo) + lo)
        value -= value % quantum
        value = max(value, -(-lo // quantum) * quantum)  # the first multiple of the step at or above min
        return min(value, hi)

    def _discrete(self, step: int):
        s = self.state["schedule_config"]
        for level, end in zip(s["difficulty"], s["max_step"]):
            if step <= end:
                return level
        return s["difficulty"][-1]

    def get_difficulty(self, global_steps: int):
        kind = self.state["schedule_type"]
        if kind == "fixed_discrete":
            return self._discrete(global_steps)
        if kind == "fixed_linear":
            return self._rooted(global_steps, 1)
        if kind == "fixed_root":
            return self._rooted(global_steps, self.state["schedule_config"]["root_degree"])
        if self.custom_get_difficulty is None:
            raise RuntimeError("custom curriculum schedule: call set_custom_get_difficulty(fn) first "
                               "(engine.set_custom_curriculum_learning_schedule in DeepSpeed)")
        return self.custom_get_difficulty(global_steps)

    def update_difficulty(self, global_steps: int):
        if self.state["current_difficulty"] < self.state["max_difficulty"]:
            self.state["current_difficulty"] = self.get_difficulty(global_steps)
        return self.state["current_difficulty"]

    # -- state (checkpoints) ---------------------------------------------------------------------------
    def get_current_difficulty(self):
        return self.state["current_difficulty"]

    def set_current_difficulty(self, difficulty) -> None:
        self.state["current_difficulty"] = difficulty

    def get_state(self) -> dict[str, Any]:
        return self.state

    def set_state(self, state: dict[str, Any]) -> None:
        self.state = state
