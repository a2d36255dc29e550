"""Point-to-point sends and receives between two ranks (pipeline activations and gradients).

Thin wrappers over ``torch.distributed``; unlike collectives they get no per-group sequence
number (the two ranks of a pair are the only ones who know about the message). Messages with
the same tag between two ranks arrive in the order they were sent.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["isend", "recv", "irecv"]


def isend(tensor: torch.Tensor, dst: int, *, tag: int = 0, group=None):
    """Start sending ``tensor`` to global rank ``dst``; keep ``tensor`` alive until the handle is waited."""
    return dist.isend(tensor, dst=dst, group=group, tag=tag)


def irecv(tensor: torch.Tensor, src: int, *, tag: int = 0, group=None):
    return dist.irecv(tensor, src=src, group=group, tag=tag)


def recv(tensor: torch.Tensor, src: int, *, tag: int = 0, group=None) -> torch.Tensor:
    """Receive into ``tensor`` from global rank ``src`` (blocks)."""
    dist.recv(tensor, src=src, group=group, tag=tag)
    return tensor
