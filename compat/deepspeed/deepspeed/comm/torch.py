"""``deepspeed.comm.torch``: DeepSpeed's ``TorchBackend`` (shardwise.comm.backend.TorchBackend, a backend
object over shardwise.comm) and the small module-level helpers DeepSpeed keeps beside it."""
from __future__ import annotations

import os

import torch

from shardwise.comm import *  # noqa: F401,F403  (DeepSpeed's module re-exports deepspeed.comm)
from shardwise.comm.backend import TorchBackend  # noqa: F401

DS_COMM_ALL_GATHER_OFF = False
DS_COMM_REDUCE_SCATTER_OFF = False
DS_COMM_BROADCAST_OFF = False
DS_COMM_ALL_REDUCE_OFF = False
DS_COMM_REDUCE_OFF = False


def known_world_size(world_size):
    """``world_size`` if positive, else ``WORLD_SIZE`` from the environment if set, else None."""
    if world_size is not None and world_size > 0:
        return world_size
    env = os.environ.get("WORLD_SIZE", "")
    return int(env) if env.isdigit() and int(env) > 0 else None


def has_coalescing_manager() -> bool:
    return hasattr(getattr(torch.distributed, "distributed_c10d", None), "_coalescing_manager")


def has_all_reduce_coalesced() -> bool:
    return hasattr(torch.distributed, "all_reduce_coalesced")


def build_shm_op():
    """DeepSpeed's shared-memory C++ collective op: not built by shardwise (collectives go through
    torch.distributed), so there is none."""
    return None


class Noop:
    def wait(self):
        return None


__all__ = ["TorchBackend", "Noop", "build_shm_op", "has_coalescing_manager", "has_all_reduce_coalesced",
           "known_world_size"]
