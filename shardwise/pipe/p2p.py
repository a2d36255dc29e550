"""Sending activations and gradients between neighbouring pipeline stages.

An activation is a tensor or a tuple of tensors. Its description (tuple or single tensor, and
each tensor's dtype and shape) goes over the wire with the first message of a channel and again
only when it changes: every message starts with one int64 that is 0 ("as before") or the length
of the new description that follows. Gradients need no description: the receiver expects one
gradient per floating-point tensor it sent, shaped like it.
"""

from __future__ import annotations

import torch

from shardwise.comm import p2p
from shardwise.pipe.module import PipelineError

ACT_TAG = 71
GRAD_TAG = 72

_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
           torch.int16, torch.int8, torch.uint8, torch.bool]
_CODE = {d: i for i, d in enumerate(_DTYPES)}


def as_tensors(value, where) -> tuple[tuple[torch.Tensor, ...], bool]:
    """``(tensors, single)``; anything but a tensor or a tuple/list of tensors is refused naming ``where``
    (a string, or a function returning it, called only then)."""
    if isinstance(value, torch.Tensor):
        return (value,), True
    if isinstance(value, (tuple, list)) and value and all(isinstance(t, torch.Tensor) for t in value):
        return tuple(value), False
    if callable(where):
        where = where()
    kinds = type(value).__name__ if not isinstance(value, (tuple, list)) else \
        f"{type(value).__name__} of ({', '.join(type(v).__name__ for v in value)})"
    raise PipelineError(f"{where} returned a {kinds}: the output of a pipeline stage must be a tensor or a "
                        "tuple of tensors (it is sent to the next stage)")


def grad_slots(tensors) -> list[int]:
    """Indices of the tensors that carry a gradient back (the floating-point ones)."""
    return [i for i, t in enumerate(tensors) if t.is_floating_point()]


def _describe(tensors, single: bool) -> list[int]:
    meta = [int(single), len(tensors)]
    for t in tensors:
        if t.dtype not in _CODE:
            raise PipelineError(f"cannot send a tensor of dtype {t.dtype} between pipeline stages")
        meta += [_CODE[t.dtype], t.dim(), *t.shape]
    return meta


def _parse(meta: list[int]):
    single, n, pos, out = bool(meta[0]), meta[1], 2, []
    for _ in range(n):
        dtype, ndim = _DTYPES[meta[pos]], meta[pos + 1]
        out.append((dtype, tuple(meta[pos + 2: pos + 2 + ndim])))
        pos += 2 + ndim
    return single, out


class ActivationSender:
    """One direction of activations to one peer; remembers the description last sent."""

    def __init__(self, peer: int) -> None:
        self.peer = peer
        self._meta: list[int] | None = None
        self.pending: list = []  # (work, tensor kept alive until sent)

    def send(self, tensors, single: bool) -> None:
        meta = _describe(tensors, single)
        if meta != self._meta:
            header = torch.tensor([len(meta)], dtype=torch.int64)
            self._isend(header)
            self._isend(torch.tensor(meta, dtype=torch.int64))
            self._meta = meta
        else:
            self._isend(torch.zeros(1, dtype=torch.int64))
        for t in tensors:
            t = t.detach().contiguous()
            self._isend(t.to(torch.uint8) if t.dtype == torch.bool else t)

    def _isend(self, t: torch.Tensor) -> None:
        self.pending.append((p2p.isend(t, self.peer, tag=ACT_TAG), t))

    def wait(self) -> None:
        for work, _ in self.pending:
            work.wait()
        self.pending.clear()


class ActivationReceiver:
    def __init__(self, peer: int, device) -> None:
        self.peer = peer
        self.device = device
        self._layout = None
        self.metadata_received = 0  # how many times a description came (tests look)

    def recv(self):
        header = p2p.recv(torch.empty(1, dtype=torch.int64), self.peer, tag=ACT_TAG)
        n = int(header.item())
        if n:
            meta = p2p.recv(torch.empty(n, dtype=torch.int64), self.peer, tag=ACT_TAG)
            self._layout = _parse(meta.tolist())
            self.metadata_received += 1
        if self._layout is None:
            raise PipelineError(f"received an activation from rank {self.peer} without its description")
        single, specs = self._layout
        out = []
        for dtype, shape in specs:
            wire = torch.uint8 if dtype == torch.bool else dtype
            t = p2p.recv(torch.empty(shape, dtype=wire, device=self.device), self.peer, tag=ACT_TAG)
            out.append(t.bool() if dtype == torch.bool else t)
        return tuple(out), single


class GradSender:
    def __init__(self, peer: int) -> None:
        self.peer = peer
        self.pending: list = []

    def send(self, grads) -> None:
        for g in grads:
            g = g.detach().contiguous()
            self.pending.append((p2p.isend(g, self.peer, tag=GRAD_TAG), g))

    def wait(self) -> None:
        for work, _ in self.pending:
            work.wait()
        self.pending.clear()


def recv_grads(peer: int, like) -> list[torch.Tensor]:
    """One gradient per tensor of ``like`` (the floating-point outputs this stage sent)."""
    return [p2p.recv(torch.empty_like(t), peer, tag=GRAD_TAG) for t in like]
