"""``deepspeed.runtime.rollout.hybrid_engine_rollout``: ``HybridEngineRollout``, the rollout engine that
generates with the training engine's own weights (``shardwise.runtime.rollout.rollout``: through the
hybrid engine's ``generate`` when ``hybrid_engine.enabled`` is set, which gathers ZeRO-3 parameters and
fuses LoRA once per call). DeepSpeed's decode accelerations (CUDA-graph capture, shared prefill,
continuous batching, per-forward profiling) are not implemented: asking for one raises a named error."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from shardwise.runtime.rollout import pad_after_eos, rollout

from .base import RolloutBatch, RolloutEngine, RolloutRequest, SamplingConfig

__all__ = ["HybridEngineRollout", "HybridEngineRolloutConfig"]


@dataclass
class HybridEngineRolloutConfig:
    use_graph_capture: bool = False
    enable_profiling: bool = False
    use_shared_prefill: bool = False
    align_decode_fronts: bool = False
    enable_cache_trimming: bool = False
    continuous_cache_capacity: Optional[int] = None


def _not_implemented(what: str) -> NotImplementedError:
    return NotImplementedError(f"HybridEngineRollout: {what} is not implemented in shardwise; the rollout generates "
                               "through the model's generate() (see docs/deepspeed-compat.md)")


class HybridEngineRollout(RolloutEngine):
    """Rollouts from ``engine`` (a ``deepspeed.initialize`` engine) with ``tokenizer``'s padding and
    end-of-sequence ids; ``cfg`` a ``HybridEngineRolloutConfig`` or ``RolloutConfig`` (or None)."""

    def __init__(self, engine, tokenizer, cfg=None):
        self.engine = engine
        self.tokenizer = tokenizer
        opt = (lambda key, default=False: getattr(cfg, key, default)) if cfg else (lambda key, default=False: default)
        self.use_graph_capture = opt("use_graph_capture")
        self.enable_profiling = opt("enable_profiling")
        self.use_shared_prefill = opt("use_shared_prefill")
        self.align_decode_fronts = opt("align_decode_fronts")
        self.enable_cache_trimming = opt("enable_cache_trimming")
        self.continuous_cache_capacity = opt("continuous_cache_capacity", None)
        self._last_profile = None
        self._last_continuous_stats = None

    def _pad_token_id(self) -> int:
        pad = self.tokenizer.pad_token_id
        if pad is None:
            pad = self.tokenizer.eos_token_id
        if pad is None:
            raise ValueError("The tokenizer must define pad_token_id or eos_token_id")
        return pad

    @torch.no_grad()
    def generate(self, request: RolloutRequest, sampling: SamplingConfig) -> RolloutBatch:
        greedy = sampling.temperature <= 0.0
        if getattr(sampling, "continuous_batch_size", None) is not None:
            raise _not_implemented("continuous batching (SamplingConfig.continuous_batch_size)")
        if self.use_graph_capture and greedy:
            return self._generate_graph(request.prompt_ids, request.prompt_attention_mask,
                                        sampling.max_new_tokens, self._pad_token_id(), self.engine.module,
                                        request.prompt_ids.device)
        if self.use_shared_prefill and sampling.n_samples_per_prompt > 1:
            raise _not_implemented("shared prefill (use_shared_prefill)")
        if self.enable_profiling:
            raise _not_implemented("per-forward rollout profiling (enable_profiling)")
        input_ids, attention_mask, start = rollout(
            self.engine, request.prompt_ids, request.prompt_attention_mask,
            max_new_tokens=sampling.max_new_tokens, pad_token_id=self._pad_token_id(),
            eos_token_id=self.tokenizer.eos_token_id, temperature=sampling.temperature, top_p=sampling.top_p,
            top_k=sampling.top_k, n_samples=sampling.n_samples_per_prompt)
        return RolloutBatch(input_ids=input_ids, attention_mask=attention_mask,
                            response_start_idx=torch.full((input_ids.shape[0], ), start, dtype=torch.long,
                                                          device=input_ids.device))

    def _generate_graph(self, prompt_ids, prompt_attn, max_new_tokens, pad_token_id, module, device):
        raise _not_implemented("CUDA-graph greedy decoding (use_graph_capture)")

    @staticmethod
    def _pad_after_eos(output_ids, response_start, eos_token_id, pad_token_id):
        return pad_after_eos(output_ids, response_start, eos_token_id, pad_token_id)

    def get_last_profile(self):
        return self._last_profile

    def get_last_continuous_stats(self):
        return self._last_continuous_stats

    def sync_weights(self, step: int) -> None:  # noqa: ARG002
        """Nothing to do: the rollout reads the training weights themselves."""
        return None
