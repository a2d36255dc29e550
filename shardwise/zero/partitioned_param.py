"""Per-parameter sharding for ZeRO stage 3, and the public questions about it.

A parameter of ``n`` elements is split into N chunks of ``c = ceil(n / N)``
elements; rank r keeps chunk r (``[r*c, min((r+1)*c, n))``, zero-padded to
``c``).  The full tensor exists only while a module needs it: ``param.data``
is then a view of a gathered buffer, otherwise an empty tensor.

A partitioned parameter carries DeepSpeed's attributes, with DeepSpeed's
meaning (``deepspeed/runtime/zero/partition_parameters.py``), so ``zero.Init``
can shard parameters as modules are built, before any engine exists:

=============== ==========================================================
``ds_id``        a unique integer per partitioned parameter
``ds_status``    ``ZeroParamStatus``: AVAILABLE (whole data present),
                 NOT_AVAILABLE (released), INFLIGHT (being gathered)
``ds_numel``     elements of the whole parameter
``ds_shape``     shape of the whole parameter
``ds_tensor``    this rank's shard (1-D, ``c`` elements; empty while the
                 shard lives in an NVMe file)
``ds_process_group`` the data-parallel group the parameter is sharded over
=============== ==========================================================

Code outside ``zero/`` asks ``is_partitioned(p)``, ``full_shape(p)`` and
``full_numel(p)`` rather than probing attributes.
"""

from __future__ import annotations

import contextlib
import itertools
from enum import Enum

import torch

from shardwise import comm
from shardwise.param_attrs import zero_unit


class ZeroParamStatus(Enum):
    AVAILABLE = 1  # the whole parameter is present in ``param.data``
    NOT_AVAILABLE = 2  # released: only this rank's shard (``ds_tensor``) exists
    INFLIGHT = 3  # an all-gather (or a read from NVMe) is under way


_ids = itertools.count()


def is_partitioned(param: torch.Tensor) -> bool:
    """True when ``param`` is a ZeRO-3 parameter: each rank keeps only a shard of it."""
    return getattr(param, "ds_tensor", None) is not None and hasattr(param, "ds_numel")


def full_shape(param: torch.Tensor) -> torch.Size:
    """The shape of the whole parameter (a partitioned one's own ``.shape`` may be empty)."""
    return param.ds_shape if is_partitioned(param) else param.shape


def full_numel(param: torch.Tensor) -> int:
    """Elements of the whole parameter."""
    return int(param.ds_numel) if is_partitioned(param) else param.numel()


def chunk_size(param: torch.nn.Parameter) -> int:
    """Elements per rank (padded) of a partitioned parameter."""
    world = comm.get_world_size(param.ds_process_group)
    return -(-param.ds_numel // world) if param.ds_numel else 0


def owned_range(param: torch.nn.Parameter) -> tuple[int, int]:
    """The ``[start, end)`` elements of the flattened parameter this rank holds (may be empty)."""
    chunk = chunk_size(param)
    start = min(comm.get_rank(param.ds_process_group) * chunk, param.ds_numel)
    return start, min(start + chunk, param.ds_numel)


def shard_param_(param: torch.nn.Parameter, *, group=None, src_rank: int = 0, broadcast: bool = True) -> None:
    """Keep only this rank's chunk of ``param`` (after making every rank's copy equal to ``src_rank``'s)."""
    world, rank = comm.get_world_size(group), comm.get_rank(group)
    data = param.data
    if broadcast and world > 1:
        src = src_rank if group is None else torch.distributed.get_global_rank(group, src_rank)
        comm.broadcast(data, src=src, group=group)
    numel = data.numel()
    chunk = -(-numel // world) if numel else 0
    flat = data.reshape(-1)
    shard = torch.zeros(chunk, dtype=data.dtype, device=data.device)
    start = min(rank * chunk, numel)
    end = min(start + chunk, numel)
    shard[: end - start].copy_(flat[start:end])
    param.ds_id = next(_ids)
    param.ds_shape = data.shape
    param.ds_numel = numel
    param.ds_tensor = shard
    param.ds_process_group = group
    param.ds_status = ZeroParamStatus.NOT_AVAILABLE
    param.data = torch.empty(0, dtype=data.dtype, device=data.device)


def unit_of(param: torch.nn.Parameter):
    """The stage-3 unit (``coordinator.Unit``) that holds ``param``'s shard, once an engine built one."""
    return zero_unit(param)


def _resident(param, *, write: bool):
    unit = unit_of(param)  # a stage-3 unit may keep the shard on disk
    return unit.resident(write=write) if unit is not None else contextlib.nullcontext()


def gather_full(param: torch.nn.Parameter) -> torch.Tensor:
    """A freshly gathered full copy of a partitioned parameter (collective over its group)."""
    group = param.ds_process_group
    world = comm.get_world_size(group)
    chunk = chunk_size(param)
    with _resident(param, write=False):
        shard = param.ds_tensor
        out = torch.empty(chunk * world, dtype=shard.dtype, device=shard.device)
        if world > 1:
            comm.all_gather_into_tensor(out, shard, group=group)
        else:
            out.copy_(shard)
    return out[: param.ds_numel].view(param.ds_shape)


def scatter_full_(param: torch.nn.Parameter, full: torch.Tensor) -> None:
    """Write this rank's chunk of ``full`` back into the shard."""
    start, end = owned_range(param)
    with _resident(param, write=True), torch.no_grad():
        param.ds_tensor[: end - start].copy_(full.reshape(-1)[start:end])
