"""What every monitor writer implements: ``write_events([(tag, value, step), ...])``."""

from __future__ import annotations

import abc
import os
from typing import Iterable, Sequence, Tuple, Union

import torch

Number = Union[int, float]
Event = Tuple[str, Union[Number, torch.Tensor], int]


def as_float(value) -> float:
    """A plain float from a Python number or a one-element tensor."""
    if isinstance(value, torch.Tensor):
        return float(value.detach().float().item())
    return float(value)


def log_dir(output_path: str, job_name: str) -> str:
    """``output_path/job_name`` (DeepSpeed's layout; an empty ``output_path`` means the working directory)."""
    return os.path.join(output_path, job_name)


class Monitor(abc.ABC):
    """One backend. Instances exist only on the rank that writes (global rank 0)."""

    name: str = "monitor"

    @abc.abstractmethod
    def write_events(self, events: Sequence[Event]) -> None:
        """Record ``(tag, value, step)`` tuples; ``step`` is DeepSpeed's x-axis, the sample count."""

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.flush()


def check_events(events: Iterable[Event]) -> list[tuple[str, float, int]]:
    """Validate and normalise user-given events; a malformed one raises naming its position."""
    out = []
    for i, ev in enumerate(events):
        if not isinstance(ev, (tuple, list)) or len(ev) != 3 or not isinstance(ev[0], str):
            raise ValueError(f"monitor.write_events: event {i} must be a (tag: str, value, step: int) tuple, got {ev!r}")
        tag, value, step = ev
        try:
            out.append((tag, as_float(value), int(step)))
        except (TypeError, ValueError, RuntimeError) as exc:
            raise ValueError(f"monitor.write_events: event {i} ({tag!r}): value and step must be numbers ({exc})") from exc
    return out
