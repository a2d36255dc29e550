"""The only place shardwise talks to ``torch.distributed``.

Everything else calls these thin wrappers. Each collective gets a per-group sequence
number and a record of what it is (``ops.py``), so a failed or timed-out collective
raises :class:`CollectiveError` naming it on every rank (``watchdog.py``), and the
comms logger (``logger.py``) can count and time it.
"""

from shardwise.comm.comm import (
    ReduceOp,
    Work,
    all_gather_into_tensor,
    all_reduce,
    barrier,
    broadcast,
    broadcast_object,
    comms_summary,
    configure,
    destroy_process_group,
    get_local_rank,
    get_rank,
    get_world_size,
    init_distributed,
    is_initialized,
    log_summary,
    new_group,
    reduce_scatter_tensor,
    reset_comms_log,
)
from shardwise.comm.compressed import compressed_all_reduce
from shardwise.comm.ops import CollectiveError, CollectiveTimeoutError
from shardwise.comm.device import get_accelerator_device, default_backend

__all__ = [
    "CollectiveError",
    "CollectiveTimeoutError",
    "ReduceOp",
    "Work",
    "all_gather_into_tensor",
    "all_reduce",
    "barrier",
    "broadcast",
    "broadcast_object",
    "comms_summary",
    "compressed_all_reduce",
    "configure",
    "default_backend",
    "destroy_process_group",
    "get_accelerator_device",
    "get_local_rank",
    "get_rank",
    "get_world_size",
    "init_distributed",
    "is_initialized",
    "log_summary",
    "new_group",
    "reduce_scatter_tensor",
    "reset_comms_log",
]
