"""``deepspeed.runtime.rollout.base``: DeepSpeed's rollout interface -- the request, batch and sampling
dataclasses (validated as DeepSpeed validates them) and the ``RolloutEngine`` base class a trainer talks
to. The generation behind ``HybridEngineRollout`` is ``shardwise.runtime.rollout``."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Optional

import torch

__all__ = ["RolloutBatch", "RolloutConfig", "RolloutEngine", "RolloutRequest", "SamplingConfig"]


@dataclass
class RolloutConfig:
    """Which rollout engine ``build_rollout`` makes (``"hybrid_engine"``) and its options."""
    engine: str = "hybrid_engine"
    use_graph_capture: bool = False


@dataclass
class SamplingConfig:
    """The sampling settings a trainer passes to ``generate`` (``top_k <= 0``: no top-k filtering;
    ``temperature <= 0``: greedy)."""
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    n_samples_per_prompt: int = 1
    continuous_batch_size: Optional[int] = None


@dataclass
class RolloutRequest:
    """Left-padded prompts ``[B, T_p]`` and their attention mask (1 on real tokens)."""
    prompt_ids: torch.Tensor
    prompt_attention_mask: torch.Tensor

    def __post_init__(self) -> None:
        if self.prompt_ids.dim() != 2:
            raise ValueError(f"prompt_ids must be 2-D [B, T_p]; got {tuple(self.prompt_ids.shape)}")
        if self.prompt_attention_mask.shape != self.prompt_ids.shape:
            raise ValueError(f"prompt_attention_mask shape {tuple(self.prompt_attention_mask.shape)} "
                             f"does not match prompt_ids {tuple(self.prompt_ids.shape)}")


@dataclass
class RolloutBatch:
    """Prompt + response ``[B * n, T_p + T_r]``, its attention mask, and each row's first response column."""
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    response_start_idx: torch.Tensor

    def __post_init__(self) -> None:
        if self.input_ids.dim() != 2:
            raise ValueError(f"input_ids must be 2-D; got {tuple(self.input_ids.shape)}")
        if self.attention_mask.shape != self.input_ids.shape:
            raise ValueError(f"attention_mask shape {tuple(self.attention_mask.shape)} does not "
                             f"match input_ids {tuple(self.input_ids.shape)}")
        rows = self.input_ids.shape[0]
        if self.response_start_idx.shape != (rows, ):
            raise ValueError(f"response_start_idx must be 1-D of length {rows}; got "
                             f"{tuple(self.response_start_idx.shape)}")

    @property
    def batch_size(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def seq_len(self) -> int:
        return int(self.input_ids.shape[1])


class RolloutEngine(ABC):
    """A rollout backend: ``generate`` a batch, ``sync_weights`` after a training step."""

    name: str = "base"

    @abstractmethod
    def generate(self, request: RolloutRequest, sampling: SamplingConfig) -> RolloutBatch:
        """Prompt and response in one tensor."""

    @abstractmethod
    def sync_weights(self, step: int) -> None:
        """Bring the backend's weights up to date (nothing to do when it shares the training weights)."""

    def shutdown(self) -> None:
        return None
