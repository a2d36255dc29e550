"""``Experts``: the local experts of one MoE layer, copies of the user's expert module.

Every parameter is marked as an expert parameter (``allreduce = False``, ``group_name`` the layer's
expert group, ``ep_size_N``): the engine reduces its gradient over the expert-data-parallel group only.
Built inside ``zero.Init``, the copies are made from the gathered expert and sharded within the
expert-data-parallel group.
"""

from __future__ import annotations

import contextlib
import copy

import torch
from torch import nn

from shardwise.zero.init import GatheredParameters
from shardwise.zero.partitioned_param import is_partitioned


class Experts(nn.Module):
    def __init__(self, expert: nn.Module, num_local_experts: int = 1, expert_group_name: str | None = None) -> None:
        super().__init__()
        held = [p for p in expert.parameters() if is_partitioned(p)]  # built under zero.Init: copy it whole
        with GatheredParameters(held) if held else contextlib.nullcontext():  # (a copy drops ZeRO's attributes)
            copies = [copy.deepcopy(expert) for _ in range(num_local_experts)]
        for p in (p for c in copies for p in c.parameters()):  # tagged before zero.Init shards them (ModuleList)
            p.allreduce = False
            p.group_name = expert_group_name
        self.deepspeed_experts = nn.ModuleList(copies)
        self.num_local_experts = num_local_experts

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        """``inputs``: ``[ranks, local experts, capacity, hidden]``; expert ``i`` gets ``inputs[:, i]``."""
        outs = []
        for chunk, expert in zip(inputs.chunk(self.num_local_experts, dim=1), self.deepspeed_experts):
            out = expert(chunk)
            outs.append(out[0] if isinstance(out, tuple) else out)  # (output, bias): the bias is ignored
        return torch.cat(outs, dim=1)
