"""Point-to-point sends and receives between two ranks, and the wire format of pipeline activations.

``isend``/``irecv``/``recv`` are thin wrappers over ``torch.distributed``; unlike collectives they get
no per-group sequence number (the two ranks of a pair are the only ones who know about the message).
Messages with the same tag between two ranks arrive in the order they were sent.

An activation is a tensor or a tuple of tensors. Its description (tuple or single tensor, and each
tensor's dtype and shape) goes over the wire with the first message of a channel and again only when
it changes: every message starts with one int64 that is 0 ("as before") or the length of the new
description that follows. Gradients need no description: the receiver expects one gradient per
floating-point tensor it sent, shaped like it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["isend", "recv", "irecv", "ActivationSender", "ActivationReceiver", "GradSender", "recv_grads",
           "WIRE_DTYPES"]


def isend(tensor: torch.Tensor, dst: int, *, tag: int = 0, group=None):
    """Start sending ``tensor`` to global rank ``dst``; keep ``tensor`` alive until the handle is waited."""
    return dist.isend(tensor, dst=dst, group=group, tag=tag)


def irecv(tensor: torch.Tensor, src: int, *, tag: int = 0, group=None):
    return dist.irecv(tensor, src=src, group=group, tag=tag)


def recv(tensor: torch.Tensor, src: int, *, tag: int = 0, group=None) -> torch.Tensor:
    """Receive into ``tensor`` from global rank ``src`` (blocks)."""
    dist.recv(tensor, src=src, group=group, tag=tag)
    return tensor


ACT_TAG = 71
GRAD_TAG = 72

WIRE_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
               torch.int16, torch.int8, torch.uint8, torch.bool]  # what an activation may hold, by wire code
_CODE = {d: i for i, d in enumerate(WIRE_DTYPES)}


def _describe(tensors, single: bool, peer: int) -> list[int]:
    meta = [int(single), len(tensors)]
    for t in tensors:
        if t.dtype not in _CODE:
            raise ValueError(f"cannot send a tensor of dtype {t.dtype} to rank {peer}: not one of {WIRE_DTYPES}")
        meta += [_CODE[t.dtype], t.dim(), *t.shape]
    return meta


def _parse(meta: list[int]):
    single, n, pos, out = bool(meta[0]), meta[1], 2, []
    for _ in range(n):
        dtype, ndim = WIRE_DTYPES[meta[pos]], meta[pos + 1]
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
        meta = _describe(tensors, single, self.peer)
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
        self.pending.append((isend(t, self.peer, tag=ACT_TAG), t))

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
        header = recv(torch.empty(1, dtype=torch.int64), self.peer, tag=ACT_TAG)
        n = int(header.item())
        if n:
            meta = recv(torch.empty(n, dtype=torch.int64), self.peer, tag=ACT_TAG)
            self._layout = _parse(meta.tolist())
            self.metadata_received += 1
        if self._layout is None:
            raise RuntimeError(f"received tensors from rank {self.peer} without their description")
        single, specs = self._layout
        out = []
        for dtype, shape in specs:
            wire = torch.uint8 if dtype == torch.bool else dtype
            t = recv(torch.empty(shape, dtype=wire, device=self.device), self.peer, tag=ACT_TAG)
            out.append(t.bool() if dtype == torch.bool else t)
        return tuple(out), single


class GradSender:
    def __init__(self, peer: int) -> None:
        self.peer = peer
        self.pending: list = []

    def send(self, grads) -> None:
        for g in grads:
            g = g.detach().contiguous()
            self.pending.append((isend(g, self.peer, tag=GRAD_TAG), g))

    def wait(self) -> None:
        for work, _ in self.pending:
            work.wait()
        self.pending.clear()


def recv_grads(peer: int, like) -> list[torch.Tensor]:
    """One gradient per tensor of ``like`` (the floating-point outputs this stage sent)."""
    return [recv(torch.empty_like(t), peer, tag=GRAD_TAG) for t in like]
