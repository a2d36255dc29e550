"""``deepspeed.utils.pin_memory_tracker``: a process-wide count of pinned (page-locked) host memory, with an
INFO line each time the total passes 32 GB, 64 GB, 128 GB, ... (pinned memory counts against ``ulimit -l``
and host out-of-memory errors surface far from where it was taken).

Only what is reported through ``track_pinned_memory(nbytes)`` is counted: shardwise's own offload buffers
are not reported here (``shardwise.profiling.memory`` measures them).
"""
from __future__ import annotations

from shardwise.utils.logging import logger

__all__ = ["track_pinned_memory", "pinned_memory_summary"]

_GB = 1 << 30
_FIRST_MARK = 32 * _GB


def _fmt_bytes(num_bytes: int) -> str:
    for unit, size, digits in (("GB", _GB, 3), ("MB", 1 << 20, 2), ("KB", 1 << 10, 1)):
        if num_bytes >= size:
            return f"{num_bytes / size:.{digits}f} {unit}"
    return f"{num_bytes} B"


class _PinnedMemoryTracker:
    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self._bytes = 0
        self._calls = 0
        self._next_checkpoint = _FIRST_MARK

    def track(self, num_bytes: int) -> None:
        self._bytes += num_bytes
        self._calls += 1
        logger.debug(f"pin_memory: +{_fmt_bytes(num_bytes)} (call #{self._calls}, total {_fmt_bytes(self._bytes)})")
        while self._bytes >= self._next_checkpoint:  # one line per mark passed, the next mark twice as far
            logger.info(f"[pinned-memory checkpoint] crossed {_fmt_bytes(self._next_checkpoint)}: "
                        f"{_fmt_bytes(self._bytes)} pinned in {self._calls} allocations")
            self._next_checkpoint *= 2

    def log_summary(self, tag: str = "") -> None:
        label = f"[pinned-memory {tag}]" if tag else "[pinned-memory]"
        logger.info(f"{label} {_fmt_bytes(self._bytes)} pinned in {self._calls} allocations")


_tracker = _PinnedMemoryTracker()


def track_pinned_memory(num_bytes: int) -> None:
    _tracker.track(num_bytes)


def pinned_memory_summary(tag: str = "") -> None:
    _tracker.log_summary(tag)
