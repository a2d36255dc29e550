"""Arithmetic that the table of refused combinations (``shardwise.parallel_dims.RULES``) and the code that lays
out the groups share, written once.

``ep_divides_data``: the experts of a MoE layer are split over ``ep_size`` ranks of the data axis; with
sequence parallelism every rank of data x sequence routes its own tokens, so ``ep_size`` must divide
data x sequence. ``check_ep_divides_data`` raises the one message for it, naming the config key.
"""

from __future__ import annotations

__all__ = ["ep_divides_data", "check_ep_divides_data"]


def ep_divides_data(ep_size: int, data: int, sequence: int = 1) -> bool:
    """Whether ``ep_size`` expert-parallel ranks tile the ``data`` x ``sequence`` ranks that route tokens."""
    return ep_size >= 1 and (data * sequence) % ep_size == 0


def check_ep_divides_data(ep_size: int, data: int, sequence: int = 1, *, key: str = "MoE ep_size") -> None:
    """``ValueError`` naming ``key`` unless ``ep_divides_data(ep_size, data, sequence)``."""
    if not ep_divides_data(ep_size, data, sequence):
        seq = f" x sequence-parallel size {sequence}" if sequence > 1 else ""
        raise ValueError(f"{key}={ep_size} does not divide the data-parallel size {data}{seq}: the experts of a "
                         f"layer are split over {key} ranks of the data axis (with sequence parallelism, of data x "
                         "sequence: every rank routes its own tokens)")
