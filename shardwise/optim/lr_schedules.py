"""Learning-rate schedules with DeepSpeed's names, parameters, defaults and formulas.

Every schedule is stepped once per optimizer step. ``last_batch_iteration``
counts the steps taken so far (-1 before the first ``step()``); constructing a
schedule with the default ``last_batch_iteration=-1`` writes the schedule's
value at -1 into the optimizer's param groups, as DeepSpeed does. The formulas
are written out in ``docs/optimizers.md``.

Scalar parameters apply to every param group; ``warmup_min_lr``,
``warmup_max_lr``, ``cycle_min_lr``, ``cycle_max_lr``, ``cycle_min_mom``,
``cycle_max_mom`` and ``lr_range_test_min_lr`` also accept one value per group.
"""

from __future__ import annotations

import logging
import math
import numbers
from typing import Any

import torch

logger = logging.getLogger(__name__)

WARMUP_TYPES = ("log", "linear")


class ScheduleParamError(ValueError):
    """A schedule parameter is invalid; ``param`` names it (without any config prefix)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param
        self.detail = message


def _torch_optimizer(optimizer: Any) -> Any:
    """The object holding ``param_groups``: the optimizer itself or the one it wraps."""
    if hasattr(optimizer, "param_groups"):
        return optimizer
    inner = getattr(optimizer, "optimizer", None)
    if inner is not None and hasattr(inner, "param_groups"):
        return inner
    raise TypeError(f"{type(optimizer).__name__} is not an optimizer: it has no param_groups")


def _check_positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
        raise ScheduleParamError(name, f"must be a positive integer, got {value!r}")
    return int(value)


def _check_number(name: str, value: Any, *, minimum: float | None = None) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ScheduleParamError(name, f"must be a number, got {value!r}")
    if minimum is not None and value < minimum:
        raise ScheduleParamError(name, f"must be >= {minimum}, got {value!r}")
    return float(value)


def _per_group(name: str, value: Any, n_groups: int) -> list[float]:
    """Broadcast a scalar to every param group, or check a per-group list."""
    if isinstance(value, (list, tuple)):
        if len(value) != n_groups:
            raise ScheduleParamError(name, f"has {len(value)} values but the optimizer has {n_groups} param groups")
        return [_check_number(name, v) for v in value]
    if isinstance(value, torch.Tensor):
        return [float(value)] * n_groups
    return [_check_number(name, value)] * n_groups


def _check_warmup_type(value: Any) -> str:
    if value not in WARMUP_TYPES:
        raise ScheduleParamError("warmup_type", f"must be one of {list(WARMUP_TYPES)}, got {value!r}")
    return value


def _write_lrs(param_groups: list[dict], lrs: list[float]) -> list[float]:
    """Set each group's lr (in place when the lr is a tensor) and return the new values."""
    for group, lr in zip(param_groups, lrs):
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr
    return [float(lr) for lr in lrs]


class _Schedule:
    """Shared stepping, state and lr bookkeeping; subclasses define ``get_lr``."""

    optimizer: Any
    last_batch_iteration: int
    _last_lr: list[float] | None = None

    def get_lr(self) -> list[float]:
        raise NotImplementedError

    def _apply(self) -> None:
        self._last_lr = _write_lrs(self.optimizer.param_groups, self.get_lr())

    def _start(self, last_batch_iteration: int) -> None:
        if isinstance(last_batch_iteration, bool) or not isinstance(last_batch_iteration, numbers.Integral):
            raise ScheduleParamError("last_batch_iteration", f"must be an integer, got {last_batch_iteration!r}")
        self.last_batch_iteration = int(last_batch_iteration)
        if self.last_batch_iteration == -1:
            self._apply()

    def step(self, last_batch_iteration: int | None = None) -> None:
        """Advance one step (or jump to ``last_batch_iteration``) and update the optimizer."""
        if last_batch_iteration is None:
            last_batch_iteration = self.last_batch_iteration + 1
        self.last_batch_iteration = int(last_batch_iteration)
        self._apply()

    def get_last_lr(self) -> list[float]:
        """The learning rates most recently written to the optimizer."""
        if self._last_lr is None:
            raise RuntimeError(f"{type(self).__name__}.get_last_lr(): call step() first")
        return list(self._last_lr)

    def state_dict(self) -> dict[str, int]:
        return {"last_batch_iteration": int(self.last_batch_iteration)}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Resume at the saved step; the optimizer gets that step's learning rate."""
        if "last_batch_iteration" not in sd:
            raise ValueError(f"{type(self).__name__}.load_state_dict: missing key 'last_batch_iteration'")
        self.last_batch_iteration = int(sd["last_batch_iteration"])
        self._apply()


class LRRangeTest(_Schedule):
    """Grow the lr from ``lr_range_test_min_lr`` to find the largest stable lr.

    ``lr = min_lr * (1 + step_rate * interval)`` with ``interval = (it + 1) / step_size``,
    floored when ``lr_range_test_staircase`` is true.
    """

    def __init__(
        self,
        optimizer: Any,
        lr_range_test_min_lr: float | list[float] = 1e-3,
        lr_range_test_step_size: int = 2000,
        lr_range_test_step_rate: float = 1.0,
        lr_range_test_staircase: bool = False,
        last_batch_iteration: int = -1,
    ) -> None:
        self.optimizer = _torch_optimizer(optimizer)
        n = len(self.optimizer.param_groups)
        self.min_lr = _per_group("lr_range_test_min_lr", lr_range_test_min_lr, n)
        self.step_size = _check_positive_int("lr_range_test_step_size", lr_range_test_step_size)
        self.step_rate = _check_number("lr_range_test_step_rate", lr_range_test_step_rate)
        if not isinstance(lr_range_test_staircase, bool):
            raise ScheduleParamError("lr_range_test_staircase", f"must be true or false, got {lr_range_test_staircase!r}")
        self.staircase = lr_range_test_staircase
        self._start(last_batch_iteration)

    def _interval(self) -> float:
        ratio = (self.last_batch_iteration + 1) / self.step_size
        return float(math.floor(ratio)) if self.staircase else ratio

    def get_lr(self) -> list[float]:
        growth = 1.0 + self.step_rate * self._interval()
        return [lr * growth for lr in self.min_lr]


class WarmupLR(_Schedule):
    """Warm the lr up from ``warmup_min_lr`` to ``warmup_max_lr`` over ``warmup_num_steps``, then hold it.

    ``warmup_max_lr=None`` (the code default in DeepSpeed >= 0.16.5) keeps each group's own lr as the peak.
    """

    def __init__(
        self,
        optimizer: Any,
        warmup_min_lr: float | list[float] = 0.0,
        warmup_max_lr: float | list[float] | None = None,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        self.optimizer = _torch_optimizer(optimizer)
        n = len(self.optimizer.param_groups)
        if warmup_max_lr is None:
            warmup_max_lr = [float(g["lr"]) for g in self.optimizer.param_groups]
        self.min_lrs = _per_group("warmup_min_lr", warmup_min_lr, n)
        self.max_lrs = _per_group("warmup_max_lr", warmup_max_lr, n)
        self.delta_lrs = [hi - lo for hi, lo in zip(self.max_lrs, self.min_lrs)]
        # DeepSpeed uses at least 2 warm-up steps so log(warmup_num_steps) is never 0.
        self.warmup_num_steps = max(2, _check_positive_int("warmup_num_steps", warmup_num_steps))
        self.warmup_type = _check_warmup_type(warmup_type)
        self.inverse_log_warm_up = 1.0 / math.log(self.warmup_num_steps)
        self._start(last_batch_iteration)

    def _warmup_gamma(self) -> float:
        if self.warmup_type == "log":
            return self.inverse_log_warm_up * math.log(self.last_batch_iteration + 1)
        return self.last_batch_iteration / self.warmup_num_steps

    def _get_gamma(self) -> float:
        if self.last_batch_iteration < self.warmup_num_steps:
            return self._warmup_gamma()
        return 1.0

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < 0:
            return list(self.min_lrs)
        gamma = self._get_gamma()
        return [lo + delta * gamma for lo, delta in zip(self.min_lrs, self.delta_lrs)]


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then a linear decay that reaches 0 at ``total_num_steps``."""

    def __init__(
        self,
        optimizer: Any,
        total_num_steps: int,
        warmup_min_lr: float | list[float] = 0.0,
        warmup_max_lr: float | list[float] = 0.001,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        self.total_num_steps = _check_positive_int("total_num_steps", total_num_steps)
        super().__init__(
            optimizer,
            warmup_min_lr=warmup_min_lr,
            warmup_max_lr=warmup_max_lr,
            warmup_num_steps=warmup_num_steps,
            warmup_type=warmup_type,
            last_batch_iteration=last_batch_iteration,
        )
        if self.total_num_steps < self.warmup_num_steps:
            logger.warning(
                "WarmupDecayLR: total_num_steps %d is less than warmup_num_steps %d",
                self.total_num_steps,
                self.warmup_num_steps,
            )

    def _get_gamma(self) -> float:
        if self.last_batch_iteration < self.warmup_num_steps:
            return self._warmup_gamma()
        remaining = self.total_num_steps - self.last_batch_iteration
        return max(0.0, remaining / max(1.0, self.total_num_steps - self.warmup_num_steps))


class WarmupCosineLR(_Schedule):
    """Scale each group's own lr by a ratio: warm-up from ``warmup_min_ratio`` to 1,
    then cosine decay to ``cos_min_ratio`` at ``total_num_steps``."""

    def __init__(
        self,
        optimizer: Any,
        total_num_steps: int,
        warmup_min_ratio: float = 0.0,
        warmup_num_steps: int = 1000,
        cos_min_ratio: float = 0.0001,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        self.optimizer = _torch_optimizer(optimizer)
        self.total_num_steps = _check_positive_int("total_num_steps", total_num_steps)
        self.warmup_min_ratio = _check_number("warmup_min_ratio", warmup_min_ratio, minimum=0.0)
        self.cos_min_ratio = _check_number("cos_min_ratio", cos_min_ratio, minimum=0.0)
        self.warmup_num_steps = max(2, _check_positive_int("warmup_num_steps", warmup_num_steps))
        self.warmup_type = _check_warmup_type(warmup_type)
        self.inverse_log_warm_up = 1.0 / math.log(self.warmup_num_steps)
        if self.total_num_steps < self.warmup_num_steps:
            logger.warning(
                "WarmupCosineLR: total_num_steps %d is less than warmup_num_steps %d",
                self.total_num_steps,
                self.warmup_num_steps,
            )
        self.org_lrs = [float(g["lr"]) for g in self.optimizer.param_groups]
        self._start(last_batch_iteration)

    def get_lr_ratio(self) -> float:
        it = self.last_batch_iteration
        if it < 0:
            return 0.0
        if it < self.warmup_num_steps:
            if self.warmup_type == "log":
                gamma = self.inverse_log_warm_up * math.log(it + 1)
            else:
                gamma = it / self.warmup_num_steps
            return self.warmup_min_ratio + gamma * (1.0 - self.warmup_min_ratio)
        progress = (it - self.warmup_num_steps + 1) / max(1, self.total_num_steps - self.warmup_num_steps)
        progress = min(1.0, progress)
        cosine = (1.0 + math.cos(math.pi * progress)) / 2.0
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def get_lr(self) -> list[float]:
        ratio = self.get_lr_ratio()
        return [lr * ratio for lr in self.org_lrs]
