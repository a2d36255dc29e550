"""DeepSpeed's ``deepspeed.moe.utils``: telling expert parameters apart and grouping them for the optimizer."""

from __future__ import annotations

from collections import defaultdict

import torch
from torch import nn


def has_moe_layers(m: nn.Module) -> tuple[bool, int]:
    """``(True, num_experts of the first MoE layer)`` or ``(False, 0)``."""
    for module in m.modules():
        if is_moe_layer(module):
            return True, module.num_experts
    return False, 0


def is_moe_layer(module: nn.Module) -> bool:
    """DeepSpeed's ``MoE`` layer, or the block AutoEP put in place of a Hugging Face MoE block."""
    from shardwise.moe.autoep.block import AutoEPMoE
    from shardwise.moe.layer import MoE

    return isinstance(module, (MoE, AutoEPMoE))


def moe_layers(m: nn.Module) -> list:
    return [module for module in m.modules() if is_moe_layer(module)]


def is_moe_param(param: torch.Tensor) -> bool:
    return hasattr(param, "allreduce") and not param.allreduce


def split_params_into_shared_and_expert_params(params):
    shared, expert = [], []
    for p in params:
        (expert if is_moe_param(p) else shared).append(p)
    return shared, expert


def split_params_grads_into_shared_and_expert_params(group):
    shared, expert = [], []
    for p in group:
        if p.grad is not None:
            (expert if is_moe_param(p) else shared).append(p.grad.to(p.dtype))
    return shared, expert


def split_params_into_different_moe_groups_for_optimizer(param_groups, max_group_size=178956971) -> list[dict]:
    """Move the expert parameters of every group into groups of their own (one per expert group name,
    ``moe: True``, ``name`` the expert group name, other options copied), cut to ``max_group_size``
    elements; the dense parameters stay where they were. Modifies and returns the list."""
    if isinstance(param_groups, tuple):
        param_groups = list(param_groups)
    elif isinstance(param_groups, dict):
        param_groups = [param_groups]
    elif not isinstance(param_groups, list):
        raise ValueError(f"Unknown param group type of {type(param_groups)}")
    names = sorted({p.group_name for g in param_groups for p in g["params"] if is_moe_param(p)})
    moe_groups: dict = defaultdict(dict)
    for g in param_groups:
        for name in names:
            moe_groups[g["name"]][name] = {**g, "name": name, "moe": True, "params": []}
    for g in param_groups:
        dense = []
        for p in g["params"]:
            if is_moe_param(p):
                moe_groups[g["name"]][p.group_name]["params"].append(p)
            else:
                dense.append(p)
        g["params"] = dense
    for per_name in moe_groups.values():
        for g in per_name.values():
            if max_group_size is None:
                param_groups.append(g)
                continue
            for chunk in _cut(g["params"], max_group_size):
                param_groups.append({**g, "params": chunk})
    return param_groups


def _cut(params, limit):
    chunks, cur, size = [], [], 0
    for p in params:
        n = getattr(p, "ds_numel", p.numel())
        if cur and size + n > limit:
            chunks.append(cur)
            cur, size = [], 0
        cur.append(p)
        size += n
    if cur:
        chunks.append(cur)
    return chunks


def is_moe_param_group(param_group) -> bool:
    return param_group.get("moe", False)


def configure_moe_param_groups(model_parameters: list):
    if not isinstance(model_parameters, list):
        raise ValueError("model_parameters must be a list")
    for p in model_parameters:
        if not isinstance(p, (torch.Tensor, dict)):
            raise TypeError("param argument that would be given to the optimizer should be an iterable of "
                            f"Tensors or dicts, but got {type(p)}")
    if isinstance(model_parameters[0], torch.nn.Parameter):
        return split_params_into_different_moe_groups_for_optimizer({"params": model_parameters,
                                                                     "name": "dense-params"})
    if not any("moe" in g for g in model_parameters):
        return split_params_into_different_moe_groups_for_optimizer(model_parameters)
    return model_parameters
