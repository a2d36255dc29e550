"""``deepspeed.utils.timer``: the engine's ``ThroughputTimer`` (shardwise.runtime.engine_compat) and
DeepSpeed's trimmed mean, which its comms logger summarises with."""
from __future__ import annotations

from statistics import mean

from shardwise.runtime.engine_compat import ThroughputTimer  # noqa: F401

__all__ = ["ThroughputTimer", "trim_mean"]


def trim_mean(data, trim_percent: float) -> float:
    """The mean of ``data`` without its ``round(len * trim_percent)`` smallest and largest values (0 for no
    data). ``data`` is left as it is."""
    assert 0.0 <= trim_percent <= 1.0, f"trim_percent must be in [0, 1], got {trim_percent}"
    if not data:
        return 0
    cut = int(round(len(data) * trim_percent))
    return mean(sorted(data)[cut:len(data) - cut])
