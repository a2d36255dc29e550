"""The ``fault_tolerance`` block (shardwise's own): replica groups on torchft (docs/fault-tolerance.md).

Each replica group is one ordinary shardwise job (any ZeRO stage inside); across replica groups
gradients are averaged over the groups in the step's quorum, and a group that joins or rejoins takes
its state from a live peer (``shardwise/ft``). Needs the ``ft`` extra: ``pip install shardwise[ft]``.
"""

from __future__ import annotations

import importlib.util
from typing import Literal

from pydantic import Field, model_validator
from pydantic_core import PydanticCustomError

from .base import ConfigModel, Float, Int

__all__ = ["FaultToleranceConfig"]


class FaultToleranceConfig(ConfigModel):
    enabled: bool = False
    # a step commits only when at least this many replica groups took part in it
    min_replicas: Int = Field(1, ge=1)
    # seconds to wait for the lighthouse to form a step's quorum (a replica group that is restarting
    # must be back within it, or the others go on without it)
    quorum_timeout: Float = Field(60.0, gt=0)
    # seconds any cross-replica collective, commit vote or live-recovery transfer may take
    timeout: Float = Field(60.0, gt=0)
    # seconds to connect to the lighthouse and to the group's manager
    connect_timeout: Float = Field(60.0, gt=0)
    # "ddp": gradients averaged across replica groups every step (HSDP); local_sgd / diloco: see support
    algorithm: Literal["ddp", "local_sgd", "diloco"] = "ddp"
    # local_sgd / diloco: optimizer steps between two synchronisations of the replica groups
    sync_every: Int = Field(100, ge=1)
    # the lighthouse address HOST:PORT (default: the TORCHFT_LIGHTHOUSE variable `shardwise run` sets)
    lighthouse: str | None = None

    @model_validator(mode="after")
    def _needs_torchft(self) -> "FaultToleranceConfig":
        if self.enabled and importlib.util.find_spec("torchft") is None:
            raise PydanticCustomError(
                "shardwise_missing_extra",
                "enabled is true but torchft is not installed: pip install shardwise[ft]")
        if self.enabled and self.algorithm != "ddp":
            raise PydanticCustomError(
                "shardwise_not_implemented",
                "algorithm {algorithm} is not implemented yet (only \"ddp\": gradients "
                "averaged across replica groups every step)", {"algorithm": repr(self.algorithm)})
        return self
