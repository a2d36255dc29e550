"""TensorBoard and CSV writers (the W&B one lives in ``wandb_monitor.py``)."""

from __future__ import annotations

import csv
import os
from typing import Sequence

from .base import Event, Monitor, as_float, log_dir


class TensorBoardMonitor(Monitor):
    """Scalars into TensorBoard event files under ``output_path/job_name``."""

    name = "tensorboard"

    def __init__(self, output_path: str, job_name: str) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise ImportError(
                "config 'tensorboard.enabled' needs the tensorboard package: pip install 'shardwise[tensorboard]'"
            ) from exc
        self.log_dir = log_dir(output_path, job_name)
        os.makedirs(self.log_dir, exist_ok=True)
        self._writer = SummaryWriter(log_dir=self.log_dir)

    def write_events(self, events: Sequence[Event]) -> None:
        for tag, value, step in events:
            self._writer.add_scalar(tag, as_float(value), int(step))
        self._writer.flush()

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


def csv_file_name(tag: str) -> str:
    """DeepSpeed's naming: ``Train/Samples/lr`` -> ``Train_Samples_lr.csv``."""
    return tag.replace("/", "_").replace(" ", "_") + ".csv"


class CSVMonitor(Monitor):
    """One CSV file per tag, columns ``step,<last part of the tag>``, appended to across runs."""

    name = "csv_monitor"

    def __init__(self, output_path: str, job_name: str) -> None:
        self.log_dir = log_dir(output_path, job_name)
        os.makedirs(self.log_dir, exist_ok=True)
        self._files: dict[str, tuple] = {}

    def _writer(self, tag: str):
        if tag not in self._files:
            path = os.path.join(self.log_dir, csv_file_name(tag))
            fh = open(path, "a", newline="")
            writer = csv.writer(fh)
            if fh.tell() == 0:
                writer.writerow(["step", tag.rsplit("/", 1)[-1]])
            self._files[tag] = (fh, writer)
        return self._files[tag][1]

    def write_events(self, events: Sequence[Event]) -> None:
        for tag, value, step in events:
            self._writer(tag).writerow([int(step), repr(as_float(value))])
        self.flush()

    def flush(self) -> None:
        for fh, _ in self._files.values():
            fh.flush()

    def close(self) -> None:
        for fh, _ in self._files.values():
            fh.close()
        self._files.clear()
