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

    def summary(self, names: list[str], *, steps: int) -> str:
        """``name: total ms per step`` for each named timer, averaged over ``steps``."""
        parts = []
        for n in names:
            if self.counts.get(n):
                parts.append(f"{n}: {1000.0 * self.elapsed[n] / max(steps, 1):.2f}")
        return " | ".join(parts) + " (ms per step)"

    def reset(self) -> None:
        self.elapsed.clear()
        self.counts.clear()
