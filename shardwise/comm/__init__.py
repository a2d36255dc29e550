"""The only place shardwise talks to ``torch.distributed``.

Everything else calls these thin wrappers, so a later comms logger or a
different backend has exactly one place to hook into.
"""

from shardwise.comm.comm import (
    ReduceOp,
    Work,
    all_gather_into_tensor,
    all_reduce,
    barrier,
    broadcast,
    broadcast_object,
    destroy_process_group,
    get_local_rank,
    get_rank,
    get_world_size,
    init_distributed,
    is_initialized,
    new_group,
    reduce_scatter_tensor,
)
from shardwise.comm.device import get_accelerator_device, default_backend

__all__ = [
    "ReduceOp",
    "Work",
    "all_gather_into_tensor",
    "all_reduce",
    "barrier",
    "broadcast",
    "broadcast_object",
    "default_backend",
    "destroy_process_group",
    "get_accelerator_device",
    "get_local_rank",
    "get_rank",
    "get_world_size",
    "init_distributed",
    "is_initialized",
    "new_group",
    "reduce_scatter_tensor",
]
