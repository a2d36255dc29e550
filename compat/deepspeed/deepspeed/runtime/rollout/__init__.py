"""``deepspeed.runtime.rollout``: DeepSpeed's rollout interface for on-policy RL / distillation training
(``RolloutRequest`` / ``RolloutBatch`` / ``SamplingConfig``, the ``RolloutEngine`` base class,
``HybridEngineRollout`` and the ``build_rollout`` factory). Generation is ``shardwise.runtime.rollout``."""
from __future__ import annotations

from .base import RolloutBatch, RolloutConfig, RolloutEngine, RolloutRequest, SamplingConfig
from .hybrid_engine_rollout import HybridEngineRollout
from .opsd import JSDLossOutput, ResponseTokenBatch, generalized_jsd_loss

__all__ = ["HybridEngineRollout", "JSDLossOutput", "RolloutBatch", "RolloutConfig", "RolloutEngine", "RolloutRequest",
           "ResponseTokenBatch", "SamplingConfig", "build_rollout", "generalized_jsd_loss"]


def build_rollout(rollout_cfg, student_engine=None, tokenizer=None, **kwargs):
    """The rollout engine ``rollout_cfg.engine`` names (``"hybrid_engine"``: needs the student's engine and
    tokenizer)."""
    engine_name = rollout_cfg.engine
    if engine_name == "hybrid_engine":
        if student_engine is None or tokenizer is None:
            raise ValueError("hybrid_engine rollout needs both student_engine and tokenizer")
        return HybridEngineRollout(engine=student_engine, tokenizer=tokenizer, cfg=rollout_cfg)
    raise ValueError(f"Unknown rollout engine {engine_name!r}; choose from 'hybrid_engine'")
