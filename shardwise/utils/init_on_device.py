"""``deepspeed.OnDevice``: build a model's tensors on a given device and floating dtype."""

from __future__ import annotations

import contextlib

import torch


class OnDevice:
    """``with OnDevice(dtype=torch.bfloat16, device="meta"): model = MyModel()`` creates the
    parameters and buffers on ``device`` (the meta device allocates nothing), floating ones in
    ``dtype``. ``enabled=False`` makes it a no-op."""

    def __init__(self, dtype, device="meta", enabled=True) -> None:
        self.dtype, self.device, self.enabled = dtype, device, enabled
        self._stack: contextlib.ExitStack | None = None
        self._old_dtype: torch.dtype | None = None

    def __enter__(self):
        if not self.enabled:
            return self
        self._stack = contextlib.ExitStack()
        self._stack.enter_context(torch.device(self.device))
        if self.dtype is not None and torch.empty(0, dtype=self.dtype).is_floating_point():
            self._old_dtype = torch.get_default_dtype()
            torch.set_default_dtype(self.dtype)
        return self

    def __exit__(self, *exc) -> None:
        if self._old_dtype is not None:
            torch.set_default_dtype(self._old_dtype)
            self._old_dtype = None
        if self._stack is not None:
            self._stack.close()
            self._stack = None
