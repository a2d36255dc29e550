"""Training that survives a lost replica group: replica groups on torchft (docs/fault-tolerance.md).

A job is R replica groups. Each group is an ordinary shardwise job with its own torch.distributed world
(its ZeRO stage, offload and other axes inside); across the groups, torchft's Manager forms a quorum at
every step (through the lighthouse), averages the gradients over the groups in it on a process group it
re-forms after a failure, and lets a group that joins or rejoins take the live state of a healthy peer
(weights, optimizer, scheduler, loss scale, step counters, data position) before its first step.

* ``shardwise.ft.engine`` (:class:`FaultTolerance`, ``attach(engine)``): what the engine holds when the ``fault_tolerance``
  block is enabled; the engine calls it before each step's first forward and before each update.
* ``shardwise.ft.state``: the live state a recovering group takes from a peer.
* ``shardwise.ft.launch``: ``shardwise run --ft_replicas R`` (the lighthouse and one launcher per group).

Importing this package does not import torchft.
"""

from __future__ import annotations

import os

__all__ = ["FaultToleranceError", "replica_group_id", "num_replica_groups"]

REPLICA_GROUP_ID = "REPLICA_GROUP_ID"  # torchft's names for the variables a replica group's processes see
NUM_REPLICA_GROUPS = "NUM_REPLICA_GROUPS"
LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"


class FaultToleranceError(RuntimeError):
    """Fault tolerance cannot go on: the lighthouse is gone, the quorum timed out, a peer's state did not fit."""


def replica_group_id() -> int:
    """This process's replica group (``REPLICA_GROUP_ID``; 0 outside a fault-tolerant launch)."""
    return int(os.environ.get(REPLICA_GROUP_ID, "0"))


def num_replica_groups() -> int:
    """How many replica groups the job was launched with (``NUM_REPLICA_GROUPS``; 1 outside one)."""
    return int(os.environ.get(NUM_REPLICA_GROUPS, "1"))

