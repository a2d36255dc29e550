"""Tiny Hugging Face MoE models (random weights) for the AutoEP tests."""

from __future__ import annotations

import torch

KINDS = ("qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v2", "deepseek_v3")


def tiny_config(kind: str):
    import transformers

    common = dict(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                  max_position_embeddings=64, initializer_range=0.2)
    deepseek = dict(intermediate_size=32, moe_intermediate_size=8, n_routed_experts=8, num_experts_per_tok=3,
                    n_group=4, topk_group=2, n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=8,
                    kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8)
    if kind == "qwen3_moe":
        c = transformers.Qwen3MoeConfig(**common, head_dim=8, intermediate_size=32, moe_intermediate_size=8,
                                        num_experts=4, num_experts_per_tok=2, norm_topk_prob=True)
    elif kind == "qwen2_moe":
        c = transformers.Qwen2MoeConfig(**common, intermediate_size=32, moe_intermediate_size=8, num_experts=4,
                                        num_experts_per_tok=2, shared_expert_intermediate_size=16)
    elif kind == "mixtral":
        c = transformers.MixtralConfig(**common, head_dim=8, intermediate_size=8, num_local_experts=4,
                                       num_experts_per_tok=2)
    elif kind == "deepseek_v2":
        c = transformers.DeepseekV2Config(**common, **deepseek, topk_method="group_limited_greedy",
                                          routed_scaling_factor=2.0)
    elif kind == "deepseek_v3":
        c = transformers.DeepseekV3Config(**common, **deepseek, routed_scaling_factor=2.5, norm_topk_prob=True)
    else:
        raise KeyError(kind)
    c._attn_implementation = "eager"
    return c


def tiny_model(kind: str, *, seed: int = 0, starve: bool = False):
    """The causal LM with random weights; DeepSeek-V3's score-correction bias random too (so it routes).
    ``starve`` (DeepSeek-V3): the upper half of the experts (expert-parallel rank 1's at ep 2) is never chosen."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config(kind))
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn(buf.shape) * 0.1)
                if starve:
                    buf[buf.numel() // 2:] -= 10.0
    return model
