"""``deepspeed.runtime.utils``: the helpers scripts import from there."""

from __future__ import annotations

import gc
import itertools
import random

import torch

from shardwise import comm

__all__ = ["move_to_device", "partition_min_spread", "prefix_sum_inc", "see_memory_usage", "set_random_seed"]


def move_to_device(item, device, criterion_func=None):
    """``item`` (a tensor, or lists, tuples and dicts of them, nested) with its tensors on ``device``
    (DeepSpeed's helper, same semantics).

    A leaf or container for which ``criterion_func`` is true is moved *in place*: its storage is
    swapped for the copy on ``device`` (``item.data = ...``), so every other reference to it sees the
    move, and it is returned itself. Everything else is walked (new lists, tuples and dicts are
    returned) and its tensors come back as ``tensor.to(device)``, as DeepSpeed does. Leaves that are
    not tensors (no ``.to``) are returned unchanged."""
    if criterion_func is not None and criterion_func(item):
        item.data = item.to(device).data
        return item
    if isinstance(item, list):
        return [move_to_device(v, device, criterion_func) for v in item]
    if isinstance(item, tuple):
        return tuple(move_to_device(v, device, criterion_func) for v in item)
    if isinstance(item, dict):
        return {k: move_to_device(v, device, criterion_func) for k, v in item.items()}
    return item.to(device) if hasattr(item, "to") else item


def prefix_sum_inc(weights) -> list:
    """The inclusive prefix sums of ``weights``: ``[3, 4, 5]`` -> ``[3, 7, 12]`` (``weights`` unchanged)."""
    return list(itertools.accumulate(weights))


def partition_min_spread(weights, num_parts: int) -> list[int]:
    """Boundaries ``[0, b1, ..., len(weights)]`` of ``num_parts`` contiguous parts whose sums are as even as
    possible: the smallest (heaviest - lightest) part sum, DeepSpeed's ``partition_balanced`` (among equal
    spreads, each cut is placed as late as possible, as DeepSpeed's search does). With no more items than
    parts: equal counts, some parts empty (``partition_uniform``)."""
    from shardwise.pipe.partition import partition_uniform

    n, m = len(weights), num_parts
    if n <= m:
        return partition_uniform(n, m)
    inf = float("inf")
    prefix = [0.0, *itertools.accumulate(float(w) for w in weights)]
    # best[i][j] = (spread, heaviest, lightest) of the first i items in j parts; cut[i][j] = start of part j
    best = [[(inf, inf, inf)] * (m + 1) for _ in range(n + 1)]
    cut = [[0] * (m + 1) for _ in range(n + 1)]
    best[0][0] = (0.0, 0.0, inf)
    for i in range(1, n + 1):
        for j in range(1, min(i, m) + 1):
            for k in range(i):
                part = prefix[i] - prefix[k]
                hi, lo = max(best[k][j - 1][1], part), min(best[k][j - 1][2], part)
                if best[i][j][0] >= hi - lo:
                    best[i][j], cut[i][j] = (hi - lo, hi, lo), k
    bounds = [n]
    for j in range(m, 0, -1):
        bounds.append(cut[bounds[-1]][j])
    return bounds[::-1]


def set_random_seed(seed):
    """Seed python's ``random``, numpy and torch (CPU and every accelerator)."""
    import numpy

    random.seed(seed)
    numpy.random.seed(seed % (2**32))  # numpy takes 32-bit seeds only
    torch.manual_seed(seed % (2**63))


def see_memory_usage(message, force=False):
    """Print ``message`` and this process's memory counters on rank 0 (nothing unless ``force``,
    as in DeepSpeed); the peak counters are reset afterwards."""
    if not force or (comm.is_initialized() and comm.get_rank() != 0):
        return
    from shardwise.accelerator import get_accelerator

    gc.collect()
    acc = get_accelerator()
    gb = 1024**3
    print(message)
    print(f"MA {acc.memory_allocated() / gb:.2f} GB  Max_MA {acc.max_memory_allocated() / gb:.2f} GB  "
          f"CA {acc.memory_reserved() / gb:.2f} GB  Max_CA {acc.max_memory_reserved() / gb:.2f} GB")
    try:
        import psutil

        vm = psutil.virtual_memory()
        total, avail, percent = vm.total, vm.available, vm.percent
    except ImportError:
        import os

        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        avail = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
        percent = round(100 * (total - avail) / total, 1)
    print(f"CPU Virtual Memory:  used = {(total - avail) / gb:.2f} GB, percent = {percent}%")
    acc.reset_peak_memory_stats()
