"""Weights & Biases writer that can never stall or crash training.

``wandb.init`` may wait for a login or an unreachable server (up to ``WANDB_INIT_TIMEOUT``
seconds, default 30), so it runs on a daemon
thread together with every ``log`` call; the training thread only puts events on a
bounded queue.  A missing package, a failed ``init`` or a full queue logs one warning
and the monitor turns itself off.  ``WANDB_MODE=offline`` works as usual.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from typing import Sequence

from .base import Event, Monitor, as_float

logger = logging.getLogger("shardwise")

_QUEUE_SIZE = 10_000
_INIT_TIMEOUT_S = 30.0
_CLOSE_WAIT_S = 10.0
_STOP = object()


class WandbMonitor(Monitor):
    name = "wandb"

    def __init__(self, *, project: str, group: str | None = None, team: str | None = None,
                 config: dict | None = None) -> None:
        self._init_kwargs = {"project": project, "group": group, "entity": team, "config": config}
        self._queue: queue.Queue = queue.Queue(maxsize=_QUEUE_SIZE)
        self._failed = False
        self._warned = False
        self.run = None
        self.ready = threading.Event()  # set once init succeeded or failed
        self._thread = threading.Thread(target=self._work, name="shardwise-wandb", daemon=True)
        self._thread.start()

    # -- training thread ---------------------------------------------------------------------
    def write_events(self, events: Sequence[Event]) -> None:
        if self._failed:
            return
        try:
            self._queue.put_nowait([(tag, as_float(v), int(step)) for tag, v, step in events])
        except queue.Full:
            self._disable("wandb is not keeping up (event queue full); W&B logging is off for this run")

    def close(self) -> None:
        try:
            self._queue.put_nowait(_STOP)
        except queue.Full:
            pass
        self._thread.join(_CLOSE_WAIT_S)
        if self._thread.is_alive():
            logger.warning("wandb did not finish within %.0f s; leaving it behind", _CLOSE_WAIT_S)

    # -- worker thread ---------------------------------------------------------------------
    def _disable(self, why: str) -> None:
        self._failed = True
        if not self._warned:
            self._warned = True
            logger.warning("wandb monitor disabled: %s", why)

    def _work(self) -> None:
        try:
            import wandb
        except ImportError:
            self._disable("the wandb package is not installed (pip install 'shardwise[wandb]')")
            self.ready.set()
            return
        try:
            timeout = float(os.environ.get("WANDB_INIT_TIMEOUT", _INIT_TIMEOUT_S))
            settings = wandb.Settings(silent=True, init_timeout=timeout)
            self.run = wandb.init(settings=settings, **self._init_kwargs)
        except Exception as exc:  # any failure to start must not reach training
            self._disable(f"wandb.init failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
            self.ready.set()
            return
        self.ready.set()
        while True:
            item = self._queue.get()
            if item is _STOP:
                break
            if self._failed:
                continue
            try:
                by_step: dict[int, dict[str, float]] = {}
                for tag, value, step in item:
                    by_step.setdefault(step, {})[tag] = value
                for step in sorted(by_step):
                    self.run.log(by_step[step], step=step)
            except Exception as exc:
                self._disable(f"wandb.log failed: {type(exc).__name__}: {exc}")
        try:
            self.run.finish()
        except Exception as exc:
            logger.warning("wandb.finish failed: %s", exc)
