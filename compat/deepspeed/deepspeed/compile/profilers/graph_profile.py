"""DeepCompile's graph profiling helpers: the per-node profile metadata (``device_time``, ``wall_time``,
``tensor_size``, ``alloc_mem``, ``max_mem``), marking a graph whose profile is incomplete, and the
warm-up / timed-repeat loops. The profiling interpreters run DeepSpeed's compiled ``dc`` ops, which
shardwise does not have."""
from __future__ import annotations

import time  # noqa: F401 -- DeepSpeed's module exposes it (tests patch graph_profile.time)

import torch
from torch.fx import Graph
from torch.utils._pytree import tree_leaves

import deepspeed.comm as dist
from deepspeed.accelerator import get_accelerator  # noqa: F401 -- part of DeepSpeed's module namespace

from ..util import get_deepcompile_handle, is_comm_op, is_release_node  # noqa: F401

_PROFILE_META_DEFAULTS = {"device_time": 0.0, "wall_time": 0.0, "tensor_size": 0, "alloc_mem": 0, "max_mem": 0}
_PROFILE_INCOMPLETE_ATTR = "_deepcompile_profile_incomplete"
_PROFILE_INCOMPLETE_META_KEY = "deepcompile_profile_incomplete"


def _node_size(out):
    """Bytes of all tensors in ``out`` (any pytree)."""
    return sum(v.element_size() * v.numel() for v in tree_leaves(out) if torch.is_tensor(v))


def _mark_profile_incomplete(graph: Graph):
    setattr(graph, _PROFILE_INCOMPLETE_ATTR, True)
    for node in graph.nodes:
        node.meta[_PROFILE_INCOMPLETE_META_KEY] = True


def is_profile_incomplete(graph: Graph):
    """Whether ``graph``'s profile was marked incomplete (on the graph or on any node); False for None."""
    if graph is None:
        return False
    return bool(getattr(graph, _PROFILE_INCOMPLETE_ATTR, False)) or \
        any(n.meta.get(_PROFILE_INCOMPLETE_META_KEY, False) for n in graph.nodes)


def _has_missing_profile_metadata(graph: Graph):
    return any(key not in n.meta for n in graph.nodes for key in _PROFILE_META_DEFAULTS)


def _backfill_missing_profile_metadata(graph: Graph, profile_complete: bool = True):
    """Give every node every profile key (zero where missing), so the scheduling passes can read them;
    a graph that lacked any, or whose profile is known incomplete, is marked incomplete first."""
    if not profile_complete or _has_missing_profile_metadata(graph):
        _mark_profile_incomplete(graph)
    for n in graph.nodes:
        for key, default in _PROFILE_META_DEFAULTS.items():
            n.meta.setdefault(key, default)


class ProfileAborted(RuntimeError):
    """Profiling failed on some rank; raised on every rank."""


def _abort_if_any_rank_failed(error, device, distributed=True):
    """Raise :class:`ProfileAborted` on every rank when any rank hit ``error`` (ranks agree by a MAX
    all-reduce of a failure flag; without a process group, only the local error counts)."""
    if not distributed or not dist.is_initialized():
        if error is not None:
            raise ProfileAborted(str(error)) from error
        return
    flag = torch.tensor([0 if error is None else 1], device=device, dtype=torch.int)
    dist.all_reduce(flag, dist.ReduceOp.MAX)
    if int(flag.item()) == 0:
        return
    if error is not None:
        raise ProfileAborted(str(error)) from error
    raise ProfileAborted("profiling failed on another rank")


def _run_warmup_for_profile(call_fn, warmup):
    """Call ``call_fn`` ``warmup`` times, dropping each result before the next call."""
    for _ in range(warmup):
        call_fn()


def _run_repeatedly_for_profile(call_fn, iteration, start_events, end_events):
    """Call ``call_fn`` ``iteration`` times between ``start_events[i].record()`` and
    ``end_events[i].record()``; every result but the last is dropped before the next call. Returns the
    last result (None when ``iteration`` is 0)."""
    out = None
    for i in range(iteration):
        out = None
        start_events[i].record()
        out = call_fn()
        end_events[i].record()
    return out
