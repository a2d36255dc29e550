"""Wall-clock timers for ``wall_clock_breakdown`` (forward, backward, allreduce, step)."""

from __future__ import annotations

import time
from collections import defaultdict

import torch


def _synchronize(device: torch.device) -> None:
    if device.type != "cpu":
        acc = getattr(torch, "accelerator", None)
        if acc is not None and acc.is_available():
            acc.synchronize()


class Timers:
    """Named timers; each accumulates elapsed seconds until ``reset``."""

    def __init__(self, device: torch.device, enabled: bool) -> None:
        self.device = device
        self.enabled = enabled
        self.elapsed: dict[str, float] = defaultdict(float)
        self.counts: dict[str, int] = defaultdict(int)
        self.last_step: dict[str, float] = {}  # seconds spent in the last optimizer step, by name
        self._at_step_start: dict[str, float] = {}
        self._started: dict[str, float] = {}

    def start(self, name: str) -> None:
        if self.enabled:
            _synchronize(self.device)
            self._started[name] = time.perf_counter()

    def stop(self, name: str) -> None:
        if self.enabled and name in self._started:
            _synchronize(self.device)
            self.elapsed[name] += time.perf_counter() - self._started.pop(name)
            self.counts[name] += 1

    def end_step(self) -> dict[str, float]:
        """Close an optimizer step: ``last_step`` becomes the seconds each timer ran since the previous call."""
        if self.enabled:
            self.last_step = {n: t - self._at_step_start.get(n, 0.0) for n, t in self.elapsed.items()}
            self._at_step_start = dict(self.elapsed)
        return self.last_step

    def summary(self, names: list[str], *, steps: int) -> str:
        """``name: <last step> ms (mean <mean over steps>)`` for each named timer that ran."""
        parts = []
        for n in names:
            if self.counts.get(n):
                mean = 1000.0 * self.elapsed[n] / max(steps, 1)
                parts.append(f"{n}: {1000.0 * self.last_step.get(n, 0.0):.2f} (mean {mean:.2f})")
        return " | ".join(parts) + " ms per step"

    def reset(self) -> None:
        self.elapsed.clear()
        self.counts.clear()
        self._at_step_start.clear()
