"""The ``expert_parallel`` block: DeepSpeed 0.19's ``AutoEPConfig`` (AutoEP for Hugging Face MoE models).

Every key of DeepSpeed 0.19.8's block is accepted with its default ("auto" means not set). What each
routing key does is in docs/moe.md ("AutoEP"). Keys that only tune DeepSpeed's kernels (``combine_impl``,
``row_weighting_impl``, ``gate_up_impl``, ``disable_triton_grouped_mm``, ``comm_num_sm``,
``comm_qp_margin``, ``comm_max_tokens_per_rank``, ``validate_folding_routing``) are accepted and change
nothing here; the ones naming features shardwise lacks are refused by ``check_supported()`` when set
(``support.py``).
"""

from __future__ import annotations

from typing import Annotated, Literal, Optional

from pydantic import Field, model_validator
from pydantic_core import PydanticCustomError

from .base import ConfigModel, Float, Int

__all__ = ["ExpertParallelConfig"]


class ExpertParallelConfig(ConfigModel):
    """``{"expert_parallel": {"enabled": true, "autoep_size": 2}}``: replace the MoE blocks of a Hugging
    Face Mixtral / Qwen2-MoE / Qwen3-MoE / DeepSeek-V2 / DeepSeek-V3 model by expert-parallel ones."""

    enabled: bool = False
    autoep_size: Annotated[Int, Field(ge=1)] = 1
    preset_model: Optional[str] = None
    moe_layer_pattern: Optional[str] = None  # a regex the module name must match (re.fullmatch)
    # routing (None: the model's own value)
    score_func: Optional[Literal["softmax", "sigmoid"]] = None
    top_k: Optional[Annotated[Int, Field(ge=1)]] = None
    route_norm: Optional[bool] = None
    route_scale: Float = 1.0
    routed_scaling_factor: Optional[Float] = None
    num_expert_groups: Optional[Annotated[Int, Field(ge=1)]] = None
    num_limited_groups: Optional[Annotated[Int, Field(ge=1)]] = None
    score_apply: Literal["auto", "pre", "post"] = "auto"
    load_balance_coeff: Optional[Annotated[Float, Field(gt=0)]] = None  # auxiliary-loss-free bias balancing
    use_grouped_mm: bool = True
    # DeepSpeed's kernel choices: accepted, no effect here
    combine_impl: Literal["auto", "weighted_sum", "fused_weighted_sum", "legacy_bmm"] = "auto"
    row_weighting_impl: Literal["auto", "eager", "fused"] = "auto"
    gate_up_impl: Literal["separate", "fused"] = "separate"
    disable_triton_grouped_mm: bool = False
    comm_num_sm: Annotated[Int, Field(ge=1)] = 12
    comm_qp_margin: Annotated[Int, Field(ge=0)] = 4
    comm_max_tokens_per_rank: Annotated[Int, Field(ge=0)] = 0
    validate_folding_routing: bool = False
    # not implemented (refused by check_supported when set)
    expert_tensor_parallel_size: Annotated[Int, Field(ge=1)] = 1
    async_split_plan: bool = False
    comm_backend: Literal["comm", "deepep"] = "comm"
    router_pattern: Optional[str] = None
    expert_pattern: Optional[str] = None
    expert_w1: Optional[str] = None
    expert_w2: Optional[str] = None
    expert_w3: Optional[str] = None
    num_experts_attr: Optional[str] = None
    top_k_attr: Optional[str] = None
    has_shared_experts: Optional[bool] = None
    shared_experts_pattern: Optional[str] = None
    shared_experts_gate_pattern: Optional[str] = None
    expert_activation: Optional[str] = None

    @model_validator(mode="after")
    def _groups_pair(self) -> "ExpertParallelConfig":
        if (self.num_limited_groups is None) != (self.num_expert_groups is None) and self.num_limited_groups:
            raise PydanticCustomError("shardwise_conflict",
                                      "expert_parallel.num_limited_groups needs expert_parallel.num_expert_groups")
        if self.num_expert_groups and self.num_limited_groups and self.num_limited_groups > self.num_expert_groups:
            raise PydanticCustomError(
                "shardwise_value", f"expert_parallel.num_limited_groups ({self.num_limited_groups}) must be at most "
                f"num_expert_groups ({self.num_expert_groups})")
        return self


# keys of the block that name a feature shardwise does not implement: (key, is it set?)
NOT_IMPLEMENTED_KEYS = {
    "expert_tensor_parallel_size": lambda b: b.expert_tensor_parallel_size > 1,
    "async_split_plan": lambda b: b.async_split_plan,
    "comm_backend": lambda b: b.comm_backend == "deepep",
    **{key: (lambda b, k=key: getattr(b, k) is not None)
       for key in ("router_pattern", "expert_pattern", "expert_w1", "expert_w2", "expert_w3", "num_experts_attr",
                   "top_k_attr", "has_shared_experts", "shared_experts_pattern", "shared_experts_gate_pattern",
                   "expert_activation")},
}
