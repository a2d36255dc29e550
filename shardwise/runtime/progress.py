"""Rank-0 progress bar (tqdm) fed by the engine at every optimizer step."""

from __future__ import annotations

import sys
import time


class _LineWriter:
    """When output is a pipe (e.g. under the launcher), print each refresh as its own line."""

    def write(self, text: str) -> None:
        text = text.replace("\r", "").strip()
        if text:
            sys.stderr.write(text + "\n")

    def flush(self) -> None:
        sys.stderr.flush()


class ProgressBar:
    """Shows step, loss, lr, samples/s, tokens/s and MFU; a no-op on every rank but global rank 0."""

    def __init__(self, *, total: int | None, enabled: bool, desc: str = "train") -> None:
        self._bar = None
        if enabled:
            from tqdm.auto import tqdm

            if sys.stderr.isatty():
                self._bar = tqdm(total=total, desc=desc, unit="step", dynamic_ncols=True)
            else:
                self._bar = tqdm(total=total, desc=desc, unit="step", file=_LineWriter(), ncols=160,
                                 mininterval=3.0, ascii=True)
        self._last = time.perf_counter()

    def update(self, *, step: int, loss: float | None, lr: float, samples: int, rates: dict | None = None) -> None:
        """``rates``: ``tokens_per_sec`` and ``mfu`` (a fraction) when known (shardwise/monitor/mfu.py)."""
        if self._bar is None:
            return
        now = time.perf_counter()
        rate = samples / max(now - self._last, 1e-9)
        self._last = now
        post = {"loss": f"{loss:.4f}" if loss is not None else "n/a", "lr": f"{lr:.3g}", "samples/s": f"{rate:.1f}"}
        if rates and rates.get("tokens_per_sec") is not None:
            post["tokens/s"] = f"{rates['tokens_per_sec']:.0f}"
        if rates and rates.get("mfu") is not None:
            post["MFU"] = f"{100 * rates['mfu']:.1f}%"
        self._bar.set_postfix(post, refresh=False)
        self._bar.update(1)

    def __enter__(self) -> "ProgressBar":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
