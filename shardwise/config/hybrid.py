"""The ``hybrid_engine`` block: an RLHF actor that trains and generates (``runtime/hybrid_engine.py``).

DeepSpeed's keys and defaults. shardwise generates with the model's own ``generate`` (DeepSpeed 0.19.8
does the same for models its inference kernels do not cover, which includes today's Hugging Face OPT
and Llama): ``max_out_tokens``, ``release_inference_cache`` and ``enable_cuda_graph`` size or keep
DeepSpeed's kernel workspace and change nothing here. ``inference_tp_size`` > 1 is refused by
``support.py`` (generation with tensor-sliced weights is not implemented).
"""

from __future__ import annotations

from pydantic import Field

from .base import ConfigModel, Int

__all__ = ["HybridEngineConfig"]


class HybridEngineConfig(ConfigModel):
    enabled: bool = False
    max_out_tokens: Int = Field(512, gt=0)
    inference_tp_size: Int = Field(1, ge=1)
    release_inference_cache: bool = False
    # ZeRO-3: gather every parameter once per generate() call (True) or each module per forward (False)
    pin_parameters: bool = True
    tp_gather_partition_size: Int = Field(8, gt=0)
    enable_cuda_graph: bool = False
