"""``deepspeed.runtime.rollout.opsd``: on-policy self-distillation helpers with DeepSpeed's checks --
``ResponseTokenBatch`` (a rollout's causal targets, response tokens only) and ``generalized_jsd_loss``
(``JSDLossOutput``). The arithmetic is ``shardwise.runtime.rollout`` (``response_targets``,
``generalized_jsd``)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from shardwise.runtime.rollout import generalized_jsd, response_targets

from .base import RolloutBatch

__all__ = ["JSDLossOutput", "ResponseTokenBatch", "generalized_jsd_loss"]


@dataclass(frozen=True)
class ResponseTokenBatch:
    """``target_ids`` / ``response_mask`` are shifted one position from ``input_ids``: the logits at ``i``
    predict ``target_ids[:, i]``."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    target_ids: torch.Tensor
    response_mask: torch.Tensor

    @classmethod
    def from_rollout(cls, rollout: RolloutBatch) -> "ResponseTokenBatch":
        if rollout.input_ids.device != rollout.attention_mask.device:
            raise ValueError("rollout input_ids and attention_mask must be on the same device")
        if rollout.input_ids.device != rollout.response_start_idx.device:
            raise ValueError("rollout input_ids and response_start_idx must be on the same device")
        if rollout.response_start_idx.dtype not in (torch.int32, torch.int64):
            raise ValueError("rollout response_start_idx must use an integer dtype")
        length = rollout.input_ids.shape[1]
        start = rollout.response_start_idx
        if bool((start < 1).any()) or bool((start > length).any()):
            raise ValueError("rollout response_start_idx must be in [1, sequence_length]")
        target_ids, response_mask = response_targets(rollout.input_ids, rollout.attention_mask, start)
        return cls(input_ids=rollout.input_ids, attention_mask=rollout.attention_mask, target_ids=target_ids,
                   response_mask=response_mask)

    def select_causal_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The logits that predict ``target_ids`` (all positions but the last)."""
        if logits.dim() != 3:
            raise ValueError("logits must be 3-D [batch, sequence_length, vocabulary_size]")
        if logits.shape[:2] != self.input_ids.shape:
            raise ValueError("logits batch and sequence dimensions must match input_ids")
        return logits[:, :-1, :]


@dataclass(frozen=True)
class JSDLossOutput:
    """The mean loss, and its sum and token count for reducing across ranks."""

    loss: torch.Tensor
    loss_sum: torch.Tensor
    valid_token_count: torch.Tensor


def generalized_jsd_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, response_mask: torch.Tensor,
                         beta: float = 0.5, temperature: float = 1.0, teacher_top_k: Optional[int] = None,
                         pointwise_clip: Optional[float] = None) -> JSDLossOutput:
    """Generalized JSD on the response tokens (``beta=0``: KL(teacher || student), ``beta=1``:
    KL(student || teacher)); see ``shardwise.runtime.rollout.generalized_jsd``."""
    if student_logits.shape != teacher_logits.shape or student_logits.dim() != 3:
        raise ValueError("student_logits and teacher_logits must have matching 3-D shapes")
    if response_mask.shape != student_logits.shape[:2]:
        raise ValueError("response_mask shape must match logits batch and sequence dimensions")
    if not 0.0 <= beta <= 1.0:
        raise ValueError("beta must be in [0, 1]")
    if temperature <= 0.0:
        raise ValueError("temperature must be positive")
    if teacher_top_k is not None and teacher_top_k <= 0:
        raise ValueError("teacher_top_k must be positive when specified")
    if teacher_top_k is not None and teacher_top_k > student_logits.shape[-1]:
        raise ValueError("teacher_top_k must not exceed the vocabulary size")
    if pointwise_clip is not None and pointwise_clip < 0.0:
        raise ValueError("pointwise_clip must be non-negative when specified")
    loss, loss_sum, count = generalized_jsd(student_logits, teacher_logits, response_mask, beta=beta,
                                            temperature=temperature, teacher_top_k=teacher_top_k,
                                            pointwise_clip=pointwise_clip)
    return JSDLossOutput(loss=loss, loss_sum=loss_sum, valid_token_count=count)
