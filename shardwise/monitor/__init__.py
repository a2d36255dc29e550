"""Training monitors: TensorBoard, CSV and W&B, written from global rank 0.

``MonitorMaster`` is what the engine exposes as ``engine.monitor``; user code may call
``engine.monitor.write_events([(tag, value, step), ...])`` on every rank (it is a no-op
everywhere but rank 0).
"""

from __future__ import annotations

import weakref
from typing import Iterable

from .base import Event, Monitor, check_events
from .writers import CSVMonitor, TensorBoardMonitor, csv_file_name

__all__ = ["MonitorMaster", "Monitor", "Event", "CSVMonitor", "TensorBoardMonitor", "WandbMonitor",
           "csv_file_name"]


def __getattr__(name: str):
    if name == "WandbMonitor":
        from .wandb_monitor import WandbMonitor

        return WandbMonitor
    raise AttributeError(name)


class MonitorMaster:
    """Fans events out to every enabled backend. ``enabled`` is the same on every rank."""

    def __init__(self, config, *, rank: int) -> None:
        self.enabled = bool(config.tensorboard.enabled or config.csv_monitor.enabled or config.wandb.enabled)
        self.rank = rank
        self.monitors: list[Monitor] = []
        if not self.enabled or rank != 0:
            return
        if config.tensorboard.enabled:
            tb = config.tensorboard
            self.monitors.append(TensorBoardMonitor(tb.output_path, tb.job_name))
        if config.csv_monitor.enabled:
            cm = config.csv_monitor
            self.monitors.append(CSVMonitor(cm.output_path, cm.job_name))
        if config.wandb.enabled:
            from .wandb_monitor import WandbMonitor

            wb = config.wandb
            self.monitors.append(WandbMonitor(project=wb.project, group=wb.group, team=wb.team,
                                              config=config.to_dict()))
        # Flush files and finish the W&B run when the monitor goes or the script ends (a finalizer, not an exit
        # handler holding the monitor: a dropped engine's monitors go with it).
        self._finalizer = weakref.finalize(self, _close_all, self.monitors)

    def write_events(self, events: Iterable[Event]) -> None:
        """Record ``(tag, value, step)`` tuples in every enabled backend (rank 0 only)."""
        if not self.monitors:
            return
        checked = check_events(events)
        for m in self.monitors:
            m.write_events(checked)

    def get(self, name: str) -> Monitor | None:
        """The backend called ``name`` ("tensorboard", "csv_monitor", "wandb"), if it is active here."""
        return next((m for m in self.monitors if m.name == name), None)

    def flush(self) -> None:
        for m in self.monitors:
            m.flush()

    def close(self) -> None:
        _close_all(self.monitors)


def _close_all(monitors: list) -> None:
    for m in monitors:
        m.close()
    monitors.clear()
