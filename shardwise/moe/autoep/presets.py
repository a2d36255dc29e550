"""The Hugging Face MoE blocks AutoEP knows, and how each one routes (``LayerSpec``).

A block is recognised by its class name; its routing is read from its own router module (top-k,
normalisation, scaling factor, groups), so a model's config edits are followed. The preset names are
DeepSpeed's (``expert_parallel.preset_model``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Literal, Optional

from torch import nn

# preset name -> (MoE block class names, expert weight names (gate, up, down), shared expert attribute,
#                 its sigmoid gate attribute)
PRESETS: dict[str, tuple[tuple[str, ...], tuple[str, str, str], Optional[str], Optional[str]]] = {
    "mixtral": (("MixtralSparseMoeBlock",), ("w1", "w3", "w2"), None, None),
    "qwen3_moe": (("Qwen3MoeSparseMoeBlock", "Qwen2MoeSparseMoeBlock"), ("gate_proj", "up_proj", "down_proj"),
                  "shared_expert", "shared_expert_gate"),
    "deepseek_v2": (("DeepseekV2Moe",), ("gate_proj", "up_proj", "down_proj"), "shared_experts", None),
    "deepseek_v3": (("DeepseekV3MoE",), ("gate_proj", "up_proj", "down_proj"), "shared_experts", None),
}


@dataclass(frozen=True)
class LayerSpec:
    """How one MoE block routes and where its pieces are."""

    preset: str
    num_experts: int
    top_k: int
    score_func: Literal["softmax", "sigmoid"]
    route_norm: bool
    route_scale: float
    num_expert_groups: Optional[int]  # group-limited routing: keep the best num_limited_groups groups
    num_limited_groups: Optional[int]
    group_score: Literal["max", "top2_sum"]  # a group's score: its best expert (V2) or its best two (V3)
    norm_eps: float  # added to the denominator of the normalisation (DeepSeek-V3: 1e-20)
    cast_scores: bool  # weights cast back to the logits' dtype (Qwen) or kept in fp32 (Mixtral, DeepSeek)
    score_apply: Literal["pre", "post"]
    weight_names: tuple[str, str, str]
    shared: Optional[str]
    shared_gate: Optional[str]
    jitter: float  # Mixtral's router_jitter_noise (training only)


def preset_of(module: nn.Module) -> Optional[str]:
    name = type(module).__name__
    for preset, (classes, *_rest) in PRESETS.items():
        if name in classes:
            return preset
    return None


def find_blocks(model: nn.Module, cfg) -> list[tuple[str, nn.Module, str]]:
    """``(name, module, preset)`` of every MoE block AutoEP replaces; a ValueError naming the module
    classes found when there is none."""
    if cfg.preset_model is not None and cfg.preset_model not in PRESETS:
        raise ValueError(f"expert_parallel.preset_model={cfg.preset_model!r}: shardwise's AutoEP knows "
                         f"{', '.join(PRESETS)} (qwen3_moe also covers Qwen2-MoE)")
    found = []
    for name, module in model.named_modules():
        preset = preset_of(module)
        if preset is None or (cfg.moe_layer_pattern and not re.fullmatch(cfg.moe_layer_pattern, name)):
            continue
        if cfg.preset_model is not None and preset != cfg.preset_model:
            continue
        found.append((name, module, preset))
    if not found:
        classes = sorted({type(m).__name__ for m in model.modules()})
        wanted = sorted(c for classes_, *_ in PRESETS.values() for c in classes_)
        filters = "".join(f", {k}={getattr(cfg, k)!r}" for k in ("preset_model", "moe_layer_pattern")
                          if getattr(cfg, k) is not None)
        raise ValueError(f"expert_parallel.enabled: no MoE block AutoEP knows in {type(model).__name__}{filters} "
                         f"(it replaces {', '.join(wanted)}); the model's module classes are: {', '.join(classes)}")
    return found


def spec_of(module: nn.Module, preset: str, cfg) -> LayerSpec:
    """The block's routing as its router computes it, with the config's overrides."""
    gate = module.gate
    if not hasattr(module.experts, "gate_up_proj") or isinstance(gate, nn.Linear):
        import transformers

        raise ValueError(f"expert_parallel: {type(module).__name__} has the transformers 4 layout (experts as a "
                         f"module list, the router a plain Linear); AutoEP reads transformers 5's fused experts "
                         f"and router modules (installed: transformers {transformers.__version__})")
    _, weight_names, shared, shared_gate = PRESETS[preset]
    num_experts = int(gate.weight.shape[0])
    groups = limited = None
    group_score = "top2_sum"
    if preset == "deepseek_v3":
        groups, limited = int(gate.num_group), int(gate.topk_group)
    elif preset == "deepseek_v2" and gate.topk_method == "group_limited_greedy":
        groups, limited, group_score = int(gate.num_group), int(gate.topk_group), "max"
    spec = LayerSpec(
        preset=preset, num_experts=num_experts, top_k=int(gate.top_k),
        score_func="sigmoid" if preset == "deepseek_v3" else "softmax",
        route_norm=bool(getattr(gate, "norm_topk_prob", preset == "mixtral")),
        route_scale=float(getattr(gate, "routed_scaling_factor", 1.0)),
        num_expert_groups=groups, num_limited_groups=limited, group_score=group_score,
        norm_eps=1e-20 if preset == "deepseek_v3" else 0.0, cast_scores=preset == "qwen3_moe",
        score_apply="post", weight_names=weight_names, shared=shared if hasattr(module, shared or "") else None,
        shared_gate=shared_gate if hasattr(module, shared_gate or "") else None,
        jitter=float(getattr(module, "jitter_noise", 0.0) or 0.0))
    return _overrides(spec, cfg)


def _overrides(spec: LayerSpec, cfg) -> LayerSpec:
    changes = {}
    for key in ("score_func", "top_k", "route_norm", "num_expert_groups", "num_limited_groups"):
        if getattr(cfg, key) is not None:
            changes[key] = getattr(cfg, key)
    if cfg.routed_scaling_factor is not None:
        changes["route_scale"] = cfg.routed_scaling_factor
    if cfg.route_scale != 1.0:
        changes["route_scale"] = cfg.route_scale
    if cfg.score_apply != "auto":
        changes["score_apply"] = cfg.score_apply
    spec = replace(spec, **changes)
    if spec.top_k > spec.num_experts:
        raise ValueError(f"expert_parallel.top_k={spec.top_k}: more than the {spec.num_experts} experts of the layer")
    if spec.num_expert_groups is not None:
        if spec.num_experts % spec.num_expert_groups:
            raise ValueError(f"expert_parallel.num_expert_groups={spec.num_expert_groups} does not divide the "
                             f"{spec.num_experts} experts of the layer")
        if spec.num_limited_groups is None:
            raise ValueError("expert_parallel.num_expert_groups needs num_limited_groups")
    return spec
