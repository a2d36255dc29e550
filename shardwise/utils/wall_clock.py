"""A group of named wall-clock timers (Megatron's and DeepSpeed's ``SynchronizedWallClockTimer``).

    timers = TimerGroup()
    timers("forward").start(); ...; timers("forward").stop()
    timers.log(["forward"])                       # "time (ms) | forward: 12.34" on rank 0, then reset
    timers("forward").elapsed(reset=False)        # milliseconds, summed over every start/stop pair

Each timer records one interval per ``start``/``stop`` pair, in milliseconds. With ``synchronize``
(the default) the accelerator is synchronized at both ends, so the interval covers the device work
queued inside it, not only the host time to queue it (DeepSpeed records device events instead; on the
host and on CPU the two agree).
"""

from __future__ import annotations

import logging
import statistics
import time

__all__ = ["Timer", "TimerGroup", "NullTimerGroup", "trimmed_mean"]

logger = logging.getLogger("shardwise")


def _synchronize() -> None:
    from shardwise.accelerator import get_accelerator

    acc = get_accelerator()
    if not acc.use_host_timers():
        acc.synchronize()


def trimmed_mean(data, trim_percent: float) -> float:
    """The mean of ``data`` without its ``round(len * trim_percent)`` smallest and largest values (0 for no
    data); ``data`` is left as it is."""
    if not 0.0 <= trim_percent <= 1.0:
        raise ValueError(f"trim_percent must be in [0, 1], got {trim_percent}")
    if not data:
        return 0
    cut = int(round(len(data) * trim_percent))
    return statistics.mean(sorted(data)[cut:len(data) - cut])


class Timer:
    """One named timer: a list of recorded intervals (ms) and whether an interval is open."""

    def __init__(self, name: str, synchronize: bool = True) -> None:
        self.name_ = name
        self.started_ = False
        self.synchronize = synchronize
        self.start_time = 0.0
        self.records: list[float] = []  # milliseconds, one per start/stop pair
        self.elapsed_records: list[float] | None = None  # the records the last elapsed() summed

    def start(self) -> None:
        if self.started_:
            raise RuntimeError(f"timer {self.name_!r} has already been started")
        if self.synchronize:
            _synchronize()
        self.start_time = time.perf_counter()
        self.started_ = True

    def stop(self, reset: bool = False, record: bool = False) -> None:
        """Close the open interval and record it (``reset``/``record`` are accepted for DeepSpeed's
        signature and change nothing, as there)."""
        if not self.started_:
            raise RuntimeError(f"timer {self.name_!r} is not started")
        if self.synchronize:
            _synchronize()
        self.records.append(1000.0 * (time.perf_counter() - self.start_time))
        self.started_ = False

    def reset(self) -> None:
        self.started_ = False
        self.elapsed_records = None
        self.records.clear()

    def elapsed(self, reset: bool = True) -> float:
        """Milliseconds over every recorded interval, an open one included up to now (it stays open);
        ``reset`` forgets them afterwards."""
        running = self.started_
        if running:
            self.stop()
        self.elapsed_records = list(self.records)
        total = sum(self.elapsed_records)
        if reset:
            self.reset()
        if running:
            self.start()
        return total

    def mean(self) -> float:
        """Trimmed mean (10% each side) of the recorded intervals, in milliseconds."""
        self.elapsed(reset=False)
        return trimmed_mean(self.elapsed_records, 0.1)


class TimerGroup:
    """Timers by name, created on first use: ``group(name)`` is the timer."""

    Timer = Timer

    def __init__(self, synchronize: bool = True) -> None:
        self.timers: dict[str, Timer] = {}
        self.synchronize = synchronize

    def __call__(self, name: str) -> Timer:
        if name not in self.timers:
            self.timers[name] = Timer(name, self.synchronize)
        return self.timers[name]

    def get_timers(self) -> dict[str, Timer]:
        return self.timers

    @staticmethod
    def memory_usage() -> str:
        from shardwise.accelerator import get_accelerator

        acc, gb = get_accelerator(), 1024**3
        return (f" | mem_allocated: {acc.memory_allocated() / gb:.4f} GB"
                f" | max_mem_allocated: {acc.max_memory_allocated() / gb:.4f} GB"
                f" | cache_allocated: {acc.memory_reserved() / gb:.4f} GB"
                f" | max_cache_allocated: {acc.max_memory_reserved() / gb:.4f} GB")

    def format(self, names, normalizer: float = 1.0, reset: bool = True, memory_breakdown: bool = False) -> str:
        """``"time (ms) | a: 1.00 | b: 2.00"`` for the named timers that exist, each divided by ``normalizer``."""
        if normalizer <= 0.0:
            raise ValueError(f"normalizer must be > 0, got {normalizer}")
        text = "time (ms)"
        for name in names:
            if name in self.timers:
                text += f" | {name}: {self.timers[name].elapsed(reset=reset) / normalizer:.2f}"
        if memory_breakdown:
            text += self.memory_usage()
        return text

    def log(self, names, normalizer: float = 1.0, reset: bool = True, memory_breakdown: bool = False,
            ranks=None) -> None:
        """Print ``format(...)`` on the given ranks (rank 0 by default)."""
        from shardwise import comm

        text = self.format(names, normalizer, reset, memory_breakdown)
        rank = comm.get_rank() if comm.is_initialized() else 0
        if rank in (ranks or [0]) or -1 in (ranks or [0]):
            print(f"[Rank {rank}] {text}", flush=True)

    def get_mean(self, names, normalizer: float = 1.0, reset: bool = True) -> dict[str, float]:
        """The trimmed mean of each named timer's intervals, times 1000 over ``normalizer`` (DeepSpeed's
        units)."""
        if normalizer <= 0.0:
            raise ValueError(f"normalizer must be > 0, got {normalizer}")
        return {name: self.timers[name].mean() * 1000.0 / normalizer for name in names if name in self.timers}


class NullTimerGroup:
    """The same interface, timing nothing (what an engine without ``wall_clock_breakdown`` hands out)."""

    class Timer:
        def start(self) -> None: ...

        def reset(self) -> None: ...

        def stop(self, **kwargs) -> None: ...

        def elapsed(self, **kwargs) -> float:
            return 0

        def mean(self) -> float:
            return 0

    def __init__(self) -> None:
        self.timer = self.Timer()

    def __call__(self, name: str):
        return self.timer

    def get_timers(self) -> dict:
        return {}

    def log(self, names, normalizer=1.0, reset=True, memory_breakdown=False, ranks=None) -> None: ...

    def get_mean(self, names, normalizer=1.0, reset=True) -> None: ...
