"""Process-group set-up and collectives."""

from __future__ import annotations

import atexit
import datetime
import logging
import os
import socket
from typing import Any

import torch
import torch.distributed as dist

from shardwise.comm import direct, ops
from shardwise.comm.device import default_backend, get_accelerator_device
from shardwise.comm.logger import CommsLogger, format_table

logger = logging.getLogger("shardwise")

ReduceOp = dist.ReduceOp
Work = Any  # the handle an async collective returns (torch.distributed.Work)

DEFAULT_TIMEOUT = datetime.timedelta(minutes=30)
_TIMEOUT_ENV = "SHARDWISE_COMM_TIMEOUT"  # seconds; set by `shardwise run --comm_timeout`


def _env_timeout() -> datetime.timedelta:
    raw = os.environ[_TIMEOUT_ENV]
    try:
        seconds = float(raw)
    except ValueError:
        seconds = -1.0
    if seconds <= 0:
        raise ValueError(f"{_TIMEOUT_ENV}={raw!r}: expected a positive number of seconds")
    return datetime.timedelta(seconds=seconds)


def resolve_timeout(timeout: datetime.timedelta | None) -> datetime.timedelta:
    """The collective timeout: the launcher's --comm_timeout, else ``timeout``, else
    DEEPSPEED_TIMEOUT (minutes, as DeepSpeed reads it), else 30 minutes."""
    if _TIMEOUT_ENV in os.environ:
        return _env_timeout()
    if timeout is not None:
        return timeout
    minutes = os.environ.get("DEEPSPEED_TIMEOUT")
    if minutes is not None:
        return datetime.timedelta(minutes=float(minutes))
    return DEFAULT_TIMEOUT


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
    timeout: datetime.timedelta | None = None,
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
    Calling it again once a group exists does nothing; ``dist_init_required=False`` with no group
    raises (as DeepSpeed's does). ``timeout`` is how long a
    collective may take before every rank raises a report naming it (see resolve_timeout).
    """
    if dist.is_initialized():
        _destroy_at_exit_once()
        return
    if dist_init_required is False:
        raise RuntimeError("init_distributed(dist_init_required=False) but no process group exists: call "
                           "torch.distributed.init_process_group() first, or pass dist_init_required=True/None")
    if timeout is not None and not isinstance(timeout, datetime.timedelta):
        raise ValueError(f"init_distributed(timeout=...) must be a datetime.timedelta, got {timeout!r}")
    env = os.environ
    if rank < 0:
        rank = int(env.get("RANK", env.get("OMPI_COMM_WORLD_RANK", "0")))
    if world_size < 0:
        world_size = int(env.get("WORLD_SIZE", env.get("OMPI_COMM_WORLD_SIZE", "1")))
    if init_method is None:
        if "MASTER_PORT" in env:
            env.setdefault("MASTER_ADDR", "127.0.0.1")
            init_method = "env://"
        elif world_size > 1:
            raise ValueError(
                f"WORLD_SIZE={world_size} but MASTER_PORT is not set: launch with "
                "`shardwise run`, torchrun, or set MASTER_ADDR/MASTER_PORT for every rank"
            )
        else:
            # Un-launched (`python train.py`): a world of one on a private port. The environment is
            # left alone, so subprocesses this one starts do not inherit a port that is in use.
            init_method = f"tcp://127.0.0.1:{_free_port()}"
    backend = dist_backend or default_backend()
    device = get_accelerator_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if verbose and rank == 0:
        logger.info("shardwise: initializing %s process group, world size %d", backend, world_size)
    timeout = resolve_timeout(timeout)
    dist.init_process_group(
        backend=backend, init_method=init_method, rank=rank, world_size=world_size, timeout=timeout
    )
    ops.reset()
    ops.timeout = timeout
    ops.on_first_op = _start_watchdog
    _destroy_at_exit_once()


_exit_hook: list[bool] = [False]


def _destroy_at_exit_once() -> None:
    """Destroy the process group when the interpreter exits, if the script did not.

    A script that ends without ``destroy_process_group()`` leaves gloo's worker threads and
    their work objects to be torn down during interpreter finalization, where releasing the
    tensors they hold can abort the process ("terminate called without an active exception",
    pytorch/pytorch#190489): seen here as a rank killed by SIGABRT after training finished.
    Skipped while one of our collectives is still in flight (a rank leaving on an exception),
    because destroying the group would then wait for it to time out."""
    if not _exit_hook[0]:
        _exit_hook[0] = True
        atexit.register(_destroy_at_exit)


def _destroy_at_exit() -> None:
    if not is_initialized() or ops.in_flight():
        return
    try:
        destroy_process_group()
    except Exception:  # noqa: BLE001 - exiting anyway; never turn a clean exit into a traceback
        pass


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_rank(group=None) -> int:
    return dist.get_rank(group) if is_initialized() else 0


def get_world_size(group=None) -> int:
    return dist.get_world_size(group) if is_initialized() else 1


def get_local_rank() -> int:
    """This process's rank on its node (LOCAL_RANK, as set by the launcher)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def new_group(ranks=None, **kwargs):
    """A new process group; it gets the collective timeout the default group has."""
    if "timeout" not in kwargs and ops.timeout is not None:
        kwargs["timeout"] = ops.timeout
    return dist.new_group(ranks=ranks, **kwargs)


_ON_DESTROY: list = []


def on_destroy(callback) -> None:
    """Call ``callback()`` whenever the world group is destroyed (state tied to its groups forgets them)."""
    _ON_DESTROY.append(callback)


def destroy_process_group() -> None:
    if is_initialized():
        _stop_watchdog()
        dist.destroy_process_group()
        ops.reset()
        ops.on_first_op = _start_watchdog
    for callback in _ON_DESTROY:
        callback()


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# Each wrapper gives ``ops.run`` the backend function and its arguments (no closure: ``ops`` calls
# nothing back in this file).

def all_reduce(tensor: torch.Tensor, op=ReduceOp.SUM, group=None, async_op: bool = False):
    return ops.run("all_reduce", dist.all_reduce, (tensor,), {"op": op, "group": group, "async_op": async_op},
                   group=group, tensors=(tensor,), nbytes=_nbytes(tensor), async_op=async_op)


def broadcast(tensor: torch.Tensor, src: int, group=None, async_op: bool = False):
    return ops.run("broadcast", dist.broadcast, (tensor,), {"src": src, "group": group, "async_op": async_op},
                   group=group, tensors=(tensor,), nbytes=_nbytes(tensor), async_op=async_op)


def broadcast_object(obj: Any, src: int = 0, group=None) -> Any:
    """Broadcast a small JSON-like python object (tag names, paths)."""
    box = [obj]
    ops.run("broadcast_object", dist.broadcast_object_list, (box,), {"src": src, "group": group},
            group=group, tensors=(), nbytes=0)
    return box[0]


def all_gather_into_tensor(output_tensor: torch.Tensor, tensor: torch.Tensor, group=None, async_op: bool = False):
    # message size: the whole gathered buffer (nccl-tests' convention)
    output = output_tensor
    impl = direct.all_gather if direct.enabled(group, output, tensor) else _all_gather_single
    return ops.run("all_gather_into_tensor", impl, (output, tensor), {"group": group, "async_op": async_op},
                   group=group, tensors=(tensor,), nbytes=_nbytes(output), async_op=async_op)


def reduce_scatter_tensor(output_tensor: torch.Tensor, tensor: torch.Tensor, op=ReduceOp.SUM, group=None,
                          async_op: bool = False):
    # message size: the whole buffer being reduced and scattered
    output = output_tensor
    if op == ReduceOp.SUM and direct.enabled(group, output, tensor):
        impl, kwargs = direct.reduce_scatter, {"group": group, "async_op": async_op}
    else:
        impl, kwargs = _reduce_scatter_single, {"op": op, "group": group, "async_op": async_op}
    return ops.run("reduce_scatter_tensor", impl, (output, tensor), kwargs,
                   group=group, tensors=(tensor,), nbytes=_nbytes(tensor), async_op=async_op)


def barrier(group=None, async_op=False, device_ids=None):
    """Wait until every rank of ``group`` (default: all) gets here; a no-op without a process group."""
    if is_initialized():
        return ops.run("barrier", dist.barrier, (), {"group": group, "async_op": async_op, "device_ids": device_ids},
                       group=group, tensors=(), nbytes=0, async_op=async_op)
    return None


# ---------------------------------------------------- DeepSpeed's other collectives (deepspeed.comm)
# ``prof``, ``log_name`` and ``debug`` are DeepSpeed's comms-logger arguments: accepted, and
# unused because the comms logger here records every collective by itself.

def all_gather(tensor_list, tensor, group=None, async_op=False, prof=False, log_name="all_gather", debug=None):
    return ops.run("all_gather", dist.all_gather, (tensor_list, tensor), {"group": group, "async_op": async_op},
                   group=group, tensors=(tensor,), nbytes=sum(_nbytes(t) for t in tensor_list), async_op=async_op)


def all_to_all_single(output, tensor, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False,
                      prof=False, log_name="all_to_all_single", debug=None):
    return ops.run("all_to_all_single", dist.all_to_all_single, (output, tensor),
                   {"output_split_sizes": output_split_sizes, "input_split_sizes": input_split_sizes,
                    "group": group, "async_op": async_op},
                   group=group, tensors=(tensor,), nbytes=_nbytes(tensor), async_op=async_op)


def reduce(tensor, dst, op=ReduceOp.SUM, group=None, async_op=False, prof=False, log_name="reduce", debug=None):
    return ops.run("reduce", dist.reduce, (tensor,), {"dst": dst, "op": op, "group": group, "async_op": async_op},
                   group=group, tensors=(tensor,), nbytes=_nbytes(tensor), async_op=async_op)


def gather(tensor, gather_list=None, dst=0, group=None, async_op=False, prof=False, log_name="gather", debug=None):
    return ops.run("gather", dist.gather, (tensor,),
                   {"gather_list": gather_list, "dst": dst, "group": group, "async_op": async_op},
                   group=group, tensors=(tensor,), nbytes=_nbytes(tensor), async_op=async_op)


def scatter(tensor, scatter_list=None, src=0, group=None, async_op=False, prof=False, log_name="scatter", debug=None):
    return ops.run("scatter", dist.scatter, (tensor,),
                   {"scatter_list": scatter_list, "src": src, "group": group, "async_op": async_op},
                   group=group, tensors=(tensor,), nbytes=_nbytes(tensor), async_op=async_op)


# Point-to-point: recorded (timeouts name them, the comms logger counts them) but, unlike the
# collectives above, only the two ranks involved take part.

def send(tensor, dst, group=None, tag=0, prof=False, log_name="send", debug=None):
    return ops.run("send", dist.send, (tensor,), {"dst": dst, "group": group, "tag": tag},
                   group=group, tensors=(tensor,), nbytes=_nbytes(tensor))


def recv(tensor, src=None, group=None, tag=0, prof=False, log_name="recv", debug=None):
    return ops.run("recv", dist.recv, (tensor,), {"src": src, "group": group, "tag": tag},
                   group=group, tensors=(tensor,), nbytes=_nbytes(tensor))


def isend(tensor, dst, group=None, tag=0, prof=False, log_name="isend", debug=None):
    return ops.run("isend", dist.isend, (tensor,), {"dst": dst, "group": group, "tag": tag},
                   group=group, tensors=(tensor,), nbytes=_nbytes(tensor), async_op=True)


def irecv(tensor, src=None, group=None, tag=0, prof=False, log_name="irecv", debug=None):
    return ops.run("irecv", dist.irecv, (tensor,), {"src": src, "group": group, "tag": tag},
                   group=group, tensors=(tensor,), nbytes=_nbytes(tensor), async_op=True)


def get_world_group():
    """The default (world) process group."""
    if not is_initialized():
        raise RuntimeError("get_world_group(): no process group yet; call shardwise.init_distributed() first")
    return dist.group.WORLD


def get_global_rank(group=None, group_rank=0) -> int:
    """The global rank of ``group_rank`` within ``group``."""
    return dist.get_global_rank(group, group_rank) if group is not None else group_rank


def get_backend(group=None) -> str:
    return dist.get_backend(group)


def is_available() -> bool:
    return dist.is_available()


def has_all_gather_into_tensor() -> bool:
    return True


def has_reduce_scatter_tensor() -> bool:
    return True


# ------------------------------------------------------------------ settings and logging

def configure(*, comms_logger: Any = None, timeout: float | datetime.timedelta | None = None) -> None:
    """Apply the config: the ``comms_logger`` block (a model or dict) and the collective timeout.

    ``timeout`` (seconds or a timedelta) is applied to the default group and every group
    created through :func:`new_group` from then on. ``SHARDWISE_COMM_TIMEOUT`` (set by
    ``shardwise run --comm_timeout``) wins over it.
    """
    if comms_logger is not None:
        block = comms_logger if isinstance(comms_logger, dict) else comms_logger.model_dump()
        if block.get("enabled"):
            ops.logger = CommsLogger(verbose=block.get("verbose", False),
                                     prof_all=block.get("prof_all", True),
                                     prof_ops=block.get("prof_ops") or [],
                                     debug=block.get("debug", False), rank=get_rank())
        else:
            ops.logger = None
    if _TIMEOUT_ENV in os.environ:
        timeout = _env_timeout()
    if timeout is not None:
        if not isinstance(timeout, datetime.timedelta):
            if timeout <= 0:
                raise ValueError(f"comm_timeout must be a positive number of seconds, got {timeout!r}")
            timeout = datetime.timedelta(seconds=timeout)
        ops.timeout = timeout
        if is_initialized():
            dist.distributed_c10d._set_pg_timeout(timeout)


def comms_summary() -> dict:
    """This rank's comms logger data (see CommsLogger.summary); {} when the logger is off."""
    return ops.logger.summary() if ops.logger is not None else {}


def reset_comms_log() -> None:
    if ops.logger is not None:
        ops.logger.reset()


def log_summary(show_straggler: bool = False) -> str:
    """Print (on rank 0) and return the comms logger's table, like ``deepspeed.comm.log_summary``.

    Call it on every rank: it synchronises them first. With ``show_straggler`` the table
    gains a column: for each op and size, this rank's total latency minus the smallest
    total latency of any rank (time spent waiting for slower ranks).
    """
    summary = comms_summary()
    straggler = None
    if is_initialized():
        dist.barrier()  # direct call: the logger does not log itself
        if show_straggler:
            totals = {(op, size): s["total_latency_ms"] for op, sizes in summary.items()
                      for size, s in sizes.items()}
            gathered: list = [None] * get_world_size()
            dist.all_gather_object(gathered, totals)
            straggler = {k: v - min(g.get(k, v) for g in gathered) for k, v in totals.items()}
    text = format_table(summary, straggler=straggler) if summary else \
        "comms logger: nothing recorded (is comms_logger.enabled set in the config?)"
    if get_rank() == 0:
        print(text, flush=True)
    return text


# ----------------------------------------------------------------------------- watchdog
_watchdog: list = [None]
_generation = [0]


def _start_watchdog() -> None:
    """Start the hang reporter once a multi-rank default group exists (see watchdog.py)."""
    ops.on_first_op = None
    if (not is_initialized() or dist.get_world_size() < 2
            or os.environ.get("SHARDWISE_COMM_WATCHDOG", "1") == "0"):
        return
    try:
        store = dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):
        return
    _generation[0] += 1
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    prefix = f"shardwise_comm/{attempt}/{_generation[0]}"
    from shardwise.comm.watchdog import Watchdog

    _watchdog[0] = Watchdog(store, rank=dist.get_rank(), world_size=dist.get_world_size(),
                            prefix=prefix)
    ops.on_failure = _watchdog[0].alarm


def _stop_watchdog() -> None:
    if _watchdog[0] is not None:
        _watchdog[0].stop()
        _watchdog[0] = None
    ops.on_failure = None


ops.on_first_op = _start_watchdog
