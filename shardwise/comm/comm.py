"""Process-group set-up and collectives."""

from __future__ import annotations

import datetime
import logging
import os
import socket
from typing import Any

import torch
import torch.distributed as dist

from shardwise.comm.device import default_backend, get_accelerator_device

logger = logging.getLogger("shardwise")

ReduceOp = dist.ReduceOp
Work = Any  # the handle an async collective returns (torch.distributed.Work)

DEFAULT_TIMEOUT = datetime.timedelta(minutes=30)

# torch 2.13 renamed the tensor-in/tensor-out collectives; older releases only have the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(
    dist_backend: str | None = None,
    auto_mpi_discovery: bool = True,
    distributed_port: int = 29500,
    verbose: bool = True,
    timeout: datetime.timedelta = DEFAULT_TIMEOUT,
    init_method: str | None = None,
    dist_init_required: bool | None = None,
    config: Any = None,
    rank: int = -1,
    world_size: int = -1,
) -> None:
    """Join (or create) the default process group, like ``deepspeed.init_distributed``.

    Reads RANK / LOCAL_RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT as set by
    ``shardwise run``, ``torchrun`` or ``deepspeed``.  Without them (a plain
    ``python train.py``) it forms a world of one process on a free local port.
    Calling it again once a group exists does nothing.
    """
    if dist_init_required is False or dist.is_initialized():
        return
    if timeout is not None and not isinstance(timeout, datetime.timedelta):
        raise ValueError(f"init_distributed(timeout=...) must be a datetime.timedelta, got {timeout!r}")
    env = os.environ
    if rank < 0:
        rank = int(env.get("RANK", env.get("OMPI_COMM_WORLD_RANK", "0")))
    if world_size < 0:
        world_size = int(env.get("WORLD_SIZE", env.get("OMPI_COMM_WORLD_SIZE", "1")))
    if init_method is None:
        env.setdefault("MASTER_ADDR", "127.0.0.1")
        if "MASTER_PORT" not in env:
            if world_size > 1:
                raise ValueError(
                    f"WORLD_SIZE={world_size} but MASTER_PORT is not set: launch with "
                    "`shardwise run`, torchrun, or set MASTER_ADDR/MASTER_PORT for every rank"
                )
            env["MASTER_PORT"] = str(_free_port())
        env.setdefault("RANK", str(rank))
        env.setdefault("WORLD_SIZE", str(world_size))
        env.setdefault("LOCAL_RANK", str(rank if world_size == 1 else env.get("LOCAL_RANK", "0")))
        init_method = "env://"
    backend = dist_backend or default_backend()
    device = get_accelerator_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if verbose and rank == 0:
        logger.info("shardwise: initializing %s process group, world size %d", backend, world_size)
    dist.init_process_group(
        backend=backend, init_method=init_method, rank=rank, world_size=world_size, timeout=timeout
    )


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_rank(group=None) -> int:
    return dist.get_rank(group) if is_initialized() else 0


def get_world_size(group=None) -> int:
    return dist.get_world_size(group) if is_initialized() else 1


def get_local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def new_group(ranks=None, **kwargs):
    return dist.new_group(ranks=ranks, **kwargs)


def destroy_process_group() -> None:
    if is_initialized():
        dist.destroy_process_group()


def all_reduce(tensor: torch.Tensor, op=ReduceOp.SUM, group=None, async_op: bool = False):
    return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


def broadcast(tensor: torch.Tensor, src: int, group=None, async_op: bool = False):
    return dist.broadcast(tensor, src=src, group=group, async_op=async_op)


def broadcast_object(obj: Any, src: int = 0, group=None) -> Any:
    """Broadcast a small JSON-like python object (tag names, paths)."""
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def all_gather_into_tensor(output: torch.Tensor, tensor: torch.Tensor, group=None, async_op: bool = False):
    return _all_gather_single(output, tensor, group=group, async_op=async_op)


def reduce_scatter_tensor(output: torch.Tensor, tensor: torch.Tensor, op=ReduceOp.SUM, group=None, async_op: bool = False):
    return _reduce_scatter_single(output, tensor, op=op, group=group, async_op=async_op)


def barrier(group=None) -> None:
    if is_initialized():
        dist.barrier(group=group)
