"""The 1Cycle schedule (Smith, 2018) with DeepSpeed's parameters and formulas.

One cycle of ``cycle_first_step_size + cycle_second_step_size`` steps moves
the lr from ``cycle_min_lr`` up to ``cycle_max_lr`` and back, while the
momentum (``betas[0]``) moves the opposite way between ``cycle_max_mom`` and
``cycle_min_mom``. After the cycle the lr decays as
``cycle_min_lr / (1 + decay_lr_rate * n / decay_step_size)`` and the momentum
grows as ``cycle_max_mom * (1 + decay_mom_rate * n / decay_step_size)``, where
``n`` counts the steps since the cycle ended. Details: ``docs/optimizers.md``.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from .lr_schedules import (
    ScheduleParamError,
    _check_number,
    _per_group,
    _Schedule,
    _torch_optimizer,
)

logger = logging.getLogger(__name__)


def _stair_count(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ScheduleParamError(name, f"must be a non-negative integer (0 disables stairs), got {value!r}")
    return value


class OneCycle(_Schedule):
    """1Cycle lr (and momentum) policy followed by an optional decay phase."""

    def __init__(
        self,
        optimizer: Any,
        cycle_min_lr: float | list[float],
        cycle_max_lr: float | list[float],
        decay_lr_rate: float = 0.0,
        cycle_first_step_size: int = 2000,
        cycle_second_step_size: int | None = None,
        cycle_first_stair_count: int = 0,
        cycle_second_stair_count: int | None = None,
        decay_step_size: int = 0,
        cycle_momentum: bool = True,
        cycle_min_mom: float | list[float] = 0.8,
        cycle_max_mom: float | list[float] = 0.9,
        decay_mom_rate: float = 0.0,
        last_batch_iteration: int = -1,
    ) -> None:
        self.optimizer = _torch_optimizer(optimizer)
        n = len(self.optimizer.param_groups)

        # Cycle shape.
        first = _check_number("cycle_first_step_size", cycle_first_step_size)
        if first <= 0:
            raise ScheduleParamError("cycle_first_step_size", f"must be positive, got {cycle_first_step_size!r}")
        if cycle_second_step_size is None:
            second = first
        else:
            second = _check_number("cycle_second_step_size", cycle_second_step_size, minimum=0.0)
        self.first_step_size = first
        self.second_step_size = second
        self.total_size = first + second
        self.step_ratio = first / self.total_size
        self.first_stair_count = _stair_count("cycle_first_stair_count", cycle_first_stair_count)
        if cycle_second_stair_count is None:
            self.second_stair_count = self.first_stair_count
        else:
            self.second_stair_count = _stair_count("cycle_second_stair_count", cycle_second_stair_count)
        self.decay_step_size = _check_number("decay_step_size", decay_step_size, minimum=0.0)

        # Learning rate.
        self.min_lrs = _per_group("cycle_min_lr", cycle_min_lr, n)
        self.max_lrs = _per_group("cycle_max_lr", cycle_max_lr, n)
        self.decay_lr_rate = _check_number("decay_lr_rate", decay_lr_rate)
        self.skip_lr_decay = math.isclose(self.decay_step_size, 0) or math.isclose(self.decay_lr_rate, 0)

        # Momentum, i.e. beta1 of Adam-style optimizers.
        if not isinstance(cycle_momentum, bool):
            raise ScheduleParamError("cycle_momentum", f"must be true or false, got {cycle_momentum!r}")
        self.cycle_momentum = cycle_momentum
        self.min_moms = _per_group("cycle_min_mom", cycle_min_mom, n)
        self.max_moms = _per_group("cycle_max_mom", cycle_max_mom, n)
        self.decay_mom_rate = _check_number("decay_mom_rate", decay_mom_rate)
        self.skip_mom_decay = math.isclose(self.decay_step_size, 0) or math.isclose(self.decay_mom_rate, 0)
        if self.cycle_momentum and "betas" not in getattr(self.optimizer, "defaults", {}):
            logger.warning(
                "OneCycle: cycle_momentum is disabled because %s has no 'betas' hyperparameter",
                type(self.optimizer).__name__,
            )
            self.cycle_momentum = False

        self._start(last_batch_iteration)

    def _get_scale_factor(self) -> float:
        batch_iteration = self.last_batch_iteration + 1
        cycle = math.floor(1 + batch_iteration / self.total_size)
        x = 1.0 + batch_iteration / self.total_size - cycle
        if x <= self.step_ratio:
            scale = x / self.step_ratio
            stairs = self.first_stair_count
        else:
            scale = (x - 1) / (self.step_ratio - 1)
            stairs = self.second_stair_count
        if stairs > 0:
            # Quantise from the integer position in the cycle so float noise cannot drop a stair.
            in_cycle = batch_iteration % self.total_size
            if in_cycle <= self.first_step_size:
                position = in_cycle * stairs / self.first_step_size
            else:
                position = (self.total_size - in_cycle) * stairs / self.second_step_size
            scale = math.floor(position) / stairs
        return scale

    def _decay_steps(self) -> float:
        return (self.last_batch_iteration - self.total_size + 1) / self.decay_step_size

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < self.total_size:
            scale = self._get_scale_factor()
            return [lo + (hi - lo) * scale for lo, hi in zip(self.min_lrs, self.max_lrs)]
        if self.skip_lr_decay:
            return list(self.min_lrs)
        factor = 1.0 + self.decay_lr_rate * self._decay_steps()
        return [lo / factor for lo in self.min_lrs]

    def _beta1(self) -> list[float]:
        if self.last_batch_iteration < self.total_size:
            scale = self._get_scale_factor()
            return [hi - (hi - lo) * scale for lo, hi in zip(self.min_moms, self.max_moms)]
        if self.skip_mom_decay:
            return list(self.max_moms)
        factor = 1.0 + self.decay_mom_rate * self._decay_steps()
        return [hi * factor for hi in self.max_moms]

    def get_mom(self) -> list[tuple[float, float]] | None:
        """The ``betas`` per group at the current step, ``(momentum, the group's beta2)`` as DeepSpeed
        returns them, or None when not cycling momentum."""
        if not self.cycle_momentum:
            return None
        return [(mom, group["betas"][1]) for mom, group in zip(self._beta1(), self.optimizer.param_groups)]

    def _apply(self) -> None:
        super()._apply()
        betas = self.get_mom()
        if betas is None:
            return
        for group, pair in zip(self.optimizer.param_groups, betas):
            group["betas"] = pair  # only beta1 cycles; the group keeps its own beta2
