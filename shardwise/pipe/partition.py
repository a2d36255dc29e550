"""Cutting a list of layers into contiguous pipeline stages.

A partition is a list of ``num_parts + 1`` boundaries ``parts``: part ``i`` holds layers
``parts[i]:parts[i + 1]`` (DeepSpeed's convention).
"""

from __future__ import annotations

import re
from typing import Sequence


def partition_uniform(num_items: int, num_parts: int) -> list[int]:
    """Equal numbers of items per part; the first ``num_items % num_parts`` parts get one more."""
    chunk, extra = divmod(num_items, num_parts)
    parts = [0]
    for i in range(num_parts):
        parts.append(parts[-1] + chunk + (1 if i < extra else 0))
    return parts


def partition_balanced(weights: Sequence[float], num_parts: int) -> list[int]:
    """Contiguous parts minimising the heaviest part (ties: the earliest cut that achieves it).

    Every part gets at least one item, so ``len(weights) >= num_parts`` is required.
    """
    n = len(weights)
    if n < num_parts:
        raise ValueError(f"cannot cut {n} layers into {num_parts} non-empty stages")
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + float(w))

    def cuts_for(limit: float) -> list[int] | None:
        # Greedy: fill each part as far as the limit allows while leaving an item for every later part.
        parts, start = [0], 0
        for p in range(num_parts - 1):
            end = start + 1
            max_end = n - (num_parts - 1 - p)
            while end < max_end and prefix[end + 1] - prefix[start] <= limit:
                end += 1
            if prefix[end] - prefix[start] > limit:
                return None
            parts.append(end)
            start = end
        if prefix[n] - prefix[start] > limit:
            return None
        return parts + [n]

    # The optimum is one of the O(n^2) contiguous sums: search them in order.
    candidates = sorted({prefix[j] - prefix[i] for i in range(n) for j in range(i + 1, n + 1)})
    lo, hi = 0, len(candidates) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if cuts_for(candidates[mid]) is None:
            lo = mid + 1
        else:
            hi = mid
    best = cuts_for(candidates[lo])
    assert best is not None
    return best


def find_layer_type(names: Sequence[str | None], pattern: str) -> list[int]:
    """Indices of the layers whose class name (``names``, None for a nameless layer) matches ``pattern``
    (a ``type:<regex>`` partition method), ignoring case."""
    regex = re.compile(pattern, re.IGNORECASE)
    return [i for i, name in enumerate(names) if name and regex.search(name)]


def check_boundaries(parts: Sequence[int], num_layers: int, num_parts: int) -> list[int]:
    parts = [int(p) for p in parts]
    if len(parts) != num_parts + 1 or parts[0] != 0 or parts[-1] != num_layers or \
            any(b <= a for a, b in zip(parts, parts[1:])):
        raise ValueError(
            f"partition_method={list(parts)}: explicit boundaries must be {num_parts + 1} strictly increasing "
            f"integers from 0 to the number of layers ({num_layers}), e.g. "
            f"{partition_uniform(num_layers, num_parts) if num_layers >= num_parts else '[0, ..., n]'}"
        )
    return parts
