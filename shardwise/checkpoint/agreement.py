"""Ranks agree on the outcome of a checkpoint step before any of them waits in a collective.

A rank that fails (a full disk, a damaged file) must not leave the others waiting for it in a
barrier that ends in a timeout naming nobody's file. Each step that can fail locally is run to
its end on every rank, its outcome (None, or the error as text naming rank and path) is gathered,
and every rank raises the same named error when any failed. Only small objects are gathered.
"""

from __future__ import annotations

import torch

from shardwise import comm


def gather_object(obj) -> list:
    """``obj`` of every rank, in rank order (a small picklable object: text, names, shapes; no tensors)."""
    if comm.get_world_size() == 1:
        return [obj]
    out = [None] * comm.get_world_size()
    torch.distributed.all_gather_object(out, obj)
    return out


class LoadFailed(ValueError):
    """Loading a checkpoint failed on another rank; raised on every rank that did not fail itself,
    naming each failure (a failing rank raises its own error)."""


def agree(error: Exception | None, raise_for_others) -> None:
    """Every rank, after a step that may have failed locally: raise this rank's own ``error``, or call
    ``raise_for_others(texts)`` with the other ranks' failures ("rank r: Type: message") when there
    are any. Collective."""
    text = None if error is None else f"rank {comm.get_rank()}: {type(error).__name__}: {error}"
    failures = [t for t in gather_object(text) if t is not None]
    if error is not None:
        raise error
    if failures:
        raise_for_others(failures)


def agree_on_load(error: Exception | None, what: str) -> None:
    """After every rank has read its part of a checkpoint: this rank's own ``error``, or
    :class:`LoadFailed` naming the ranks that failed. Collective (it ends a load)."""

    def others(failures: list[str]) -> None:
        raise LoadFailed(f"{what} failed on {len(failures)} rank(s); nothing can be resumed from it:\n  "
                         + "\n  ".join(failures))

    agree(error, others)
