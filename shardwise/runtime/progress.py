"""Rank-0 progress bar (tqdm) fed by the engine at every optimizer step."""

from __future__ import annotations

import time


class ProgressBar:
    """Shows step, loss, lr and samples/s; a no-op on every rank but global rank 0."""

    def __init__(self, *, total: int | None, enabled: bool, desc: str = "train") -> None:
        self._bar = None
        if enabled:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total, desc=desc, unit="step", dynamic_ncols=True)
        self._last = time.perf_counter()

    def update(self, *, step: int, loss: float | None, lr: float, samples: int) -> None:
        if self._bar is None:
            return
        now = time.perf_counter()
        rate = samples / max(now - self._last, 1e-9)
        self._last = now
        post = {"loss": f"{loss:.4f}" if loss is not None else "n/a", "lr": f"{lr:.3g}", "samples/s": f"{rate:.1f}"}
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
