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

__all__ = ["FaultToleranceConfig", "OuterOptimizerConfig"]


class OuterOptimizerConfig(ConfigModel):
    """DiLoCo's outer optimizer: steps the averaged pseudo-gradients (an ``optimizer`` block's names)."""

    type: str = "SGD"
    # the DiLoCo paper's outer optimizer: Nesterov momentum
    params: dict = Field(default_factory=lambda: {"lr": 0.7, "momentum": 0.9, "nesterov": True})


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
    # "ddp": gradients averaged across replica groups every step (HSDP); "local_sgd": each group steps
    # alone, the weights are averaged every sync_every steps; "diloco": each group steps alone, every
    # sync_every steps the averaged pseudo-gradient (weights at the last sync - weights now) is stepped
    # by outer_optimizer (torchft.local_sgd.LocalSGD / DiLoCo)
    algorithm: Literal["ddp", "local_sgd", "diloco"] = "ddp"
    # local_sgd / diloco: optimizer steps between two synchronisations of the replica groups
    sync_every: Int = Field(100, ge=1)
    # diloco: the outer optimizer
    outer_optimizer: OuterOptimizerConfig | None = None
    # diloco (Streaming DiLoCo): the weights in this many fragments, synchronised in turn
    fragments: Int = Field(1, ge=1)
    # diloco: inner steps between sending a fragment's pseudo-gradient and waiting for its average
    fragment_sync_delay: Int = Field(0, ge=0)
    # diloco: weight of the local weights when mixed with the outer step's result (0: the outer result)
    fragment_update_alpha: Float = Field(0.0, ge=0, le=1)
    # the lighthouse address HOST:PORT (default: the TORCHFT_LIGHTHOUSE variable `shardwise run` sets)
    lighthouse: str | None = None

    @model_validator(mode="after")
    def _needs_torchft(self) -> "FaultToleranceConfig":
        if self.enabled and importlib.util.find_spec("torchft") is None:
            raise PydanticCustomError(
                "shardwise_missing_extra",
                "enabled is true but torchft is not installed: pip install shardwise[ft]")
        # (keys set to a value other than their default: the effective config, written out by to_dict() with
        # every default, loads again)
        fields = type(self).model_fields
        given = {k for k in self.model_fields_set if getattr(self, k) != fields[k].default}
        if self.algorithm == "ddp" and "sync_every" in given:
            raise PydanticCustomError(
                "shardwise_conflict", "sync_every is for algorithm \"local_sgd\" or \"diloco\"; algorithm "
                "\"ddp\" synchronises at every step")
        diloco_only = sorted(k for k in ("outer_optimizer", "fragments", "fragment_sync_delay", "fragment_update_alpha")
                             if k in given)
        if self.algorithm != "diloco" and diloco_only:
            raise PydanticCustomError(
                "shardwise_conflict", "{keys} {verb} for algorithm \"diloco\" (algorithm is {algorithm})",
                {"keys": ", ".join(diloco_only), "verb": "is" if len(diloco_only) == 1 else "are",
                 "algorithm": repr(self.algorithm)})
        if self.algorithm == "diloco":
            # torchft's DiLoCo: one fragment synchronised at a time, each once per sync_every steps
            if self.sync_every % self.fragments:
                raise PydanticCustomError(
                    "shardwise_conflict", "sync_every {sync_every} must be a multiple of fragments {fragments} "
                    "(torchft's DiLoCo synchronises one fragment every sync_every / fragments steps)",
                    {"sync_every": self.sync_every, "fragments": self.fragments})
            if self.fragment_sync_delay >= self.sync_every // self.fragments:
                raise PydanticCustomError(
                    "shardwise_conflict", "fragment_sync_delay {delay} must be less than sync_every / fragments "
                    "= {period} (a fragment must be synchronised before it is sent again)",
                    {"delay": self.fragment_sync_delay, "period": self.sync_every // self.fragments})
            if self.outer_optimizer is None:
                self.outer_optimizer = OuterOptimizerConfig()
        return self
