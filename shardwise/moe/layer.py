"""``MoE``: DeepSpeed's mixture-of-experts layer (``deepspeed.moe.layer.MoE``), same arguments and results.

``forward(hidden_states, used_token=None)`` returns ``(output, l_aux, exp_counts)``. With ``ep_size`` N
the ``num_experts`` are split over N ranks of the data axis (``num_experts / N`` local copies of
``expert`` on each); the engine creates the groups (``set_deepspeed_parallelism``) when it finds the layer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shardwise.moe.experts import Experts
from shardwise.moe.sharded_moe import MOELayer, TopKGate


class MoE(nn.Module):
    local_experts_path = "deepspeed_moe.experts.deepspeed_experts"  # this rank's expert list (moe.parallel)

    def __init__(self, hidden_size: int, expert: nn.Module, num_experts: int = 1, ep_size: int = 1, k: int = 1,
                 capacity_factor: float = 1.0, eval_capacity_factor: float = 1.0, min_capacity: int = 4,
                 use_residual: bool = False, noisy_gate_policy: str | None = None, drop_tokens: bool = True,
                 use_rts: bool = True, use_tutel: bool = False, enable_expert_tensor_parallelism: bool = False,
                 top2_2nd_expert_sampling: bool = True) -> None:
        super().__init__()
        if not isinstance(ep_size, int) or ep_size < 1:
            raise ValueError(f"MoE ep_size must be an integer >= 1, got {ep_size!r}")
        if num_experts % ep_size:
            raise ValueError(f"MoE num_experts ({num_experts}) is not divisible by ep_size ({ep_size}): every "
                             "expert-parallel rank must hold the same number of experts")
        if enable_expert_tensor_parallelism:
            raise ValueError("MoE enable_expert_tensor_parallelism=True: tensor-parallel experts are not "
                             "implemented in shardwise (see docs/moe.md)")
        # use_tutel: Tutel's kernels are an optimisation of the same routing; shardwise has none (ignored)
        self.use_residual = use_residual
        self.enable_expert_tensor_parallelism = enable_expert_tensor_parallelism
        self.ep_size = ep_size
        self.expert_group_name = f"ep_size_{ep_size}"
        self.num_experts = num_experts
        self.num_local_experts = num_experts // ep_size
        experts = Experts(expert, self.num_local_experts, self.expert_group_name)
        gate = TopKGate(hidden_size, num_experts, k, capacity_factor, eval_capacity_factor, min_capacity,
                        noisy_gate_policy, drop_tokens, use_rts, None, top2_2nd_expert_sampling)
        self.deepspeed_moe = MOELayer(gate, experts, self.expert_group_name, ep_size, self.num_local_experts)
        if use_residual:
            self.mlp = expert
            self.coefficient = nn.Linear(hidden_size, 2)

    def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False) -> None:
        """Take the expert-parallel and expert-data-parallel groups of ``ep_size`` from the active grid
        (``shardwise.topology.expert_groups``: created there on first use, collective) and hand the
        expert-parallel one to the layer."""
        self._create_process_groups(use_data_before_expert_parallel_=use_data_before_expert_parallel_)

    def _create_process_groups(self, use_data_before_expert_parallel_: bool = False) -> None:
        from shardwise.topology import expert_groups

        # the active grid's (the engine's) groups of this ep_size; created there on first use
        self.expert_groups = expert_groups(self.ep_size, data_before_expert=use_data_before_expert_parallel_)
        self.deepspeed_moe._set_ep_group(self.expert_groups.group)

    def forward(self, hidden_states: torch.Tensor, used_token: torch.Tensor | None = None):
        output = self.deepspeed_moe(hidden_states, used_token)
        if self.use_residual:  # Residual MoE: a dense MLP beside the experts, mixed by a learned softmax
            mlp = self.mlp(hidden_states)
            mlp = mlp[0] if isinstance(mlp, tuple) else mlp
            coef = F.softmax(self.coefficient(hidden_states), dim=-1)
            output = output * coef[..., 0:1] + mlp * coef[..., 1:]
        return output, self.deepspeed_moe.l_aux, self.deepspeed_moe.exp_counts
