"""``apply_autoep``: swap a Hugging Face model's MoE blocks for ``AutoEPMoE`` blocks (at ``initialize``).

Runs with the engine's grid active: it creates the ``ep_size_N`` expert groups, keeps this rank's
experts, and points an optimizer (or ``model_parameters``) built on the original model at the new expert
parameters.
"""

from __future__ import annotations

import torch
from torch import nn

from shardwise.moe.autoep.block import AutoEPMoE
from shardwise.moe.autoep.presets import find_blocks, spec_of
from shardwise.parallel_dims import check_expert_size
from shardwise.zero.init import GatheredParameters


def check_sizes(model: nn.Module, cfg, *, data_size: int) -> list:
    """The blocks to replace, with the sizes checked (before any group exists): ValueErrors name the key."""
    blocks = find_blocks(model, cfg)
    ep = cfg.autoep_size
    check_expert_size(ep, data_size, key="expert_parallel.autoep_size")
    for name, module, preset in blocks:
        spec = spec_of(module, preset, cfg)
        if spec.num_experts % ep:
            divisors = [d for d in range(1, spec.num_experts + 1) if spec.num_experts % d == 0]
            raise ValueError(f"expert_parallel.autoep_size={ep}: the {spec.num_experts} experts of {name} "
                             f"({type(module).__name__}) are not divisible by it (divisors: {divisors})")
    return blocks


def apply_autoep(model: nn.Module, cfg, *, optimizer=None, model_parameters=None):
    """Replace every recognised MoE block; returns ``(model, model_parameters)`` (the optimizer, if an
    instance, is updated in place). Collective when ``autoep_size`` > 1 (creates the expert groups)."""
    from shardwise.topology import expert_groups

    ep = cfg.autoep_size
    ep_rank = expert_groups(ep).rank if ep > 1 else 0  # the active (engine's) grid's; collective on first use
    sources: dict[int, list[torch.Tensor]] = {}
    for path, module, preset in find_blocks(model, cfg):
        with GatheredParameters(list(module.experts.parameters())):  # (built under zero.Init: whole first)
            block = AutoEPMoE(module, spec_of(module, preset, cfg), ep_size=ep, ep_rank=ep_rank,
                              use_grouped_mm=cfg.use_grouped_mm, load_balance_coeff=cfg.load_balance_coeff)
        gate_up = [p for e in block.experts for p in e.weights()[:2]]
        sources[id(module.experts.gate_up_proj)] = gate_up
        sources[id(module.experts.down_proj)] = [e.weights()[2] for e in block.experts]
        parent, _, child = path.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, block)
    if isinstance(optimizer, torch.optim.Optimizer):
        if optimizer.state:
            raise ValueError("expert_parallel: the optimizer passed to initialize() already has state; AutoEP "
                             "replaces the expert parameters, so build the optimizer before any step")
        for group in optimizer.param_groups:
            group["params"] = _remap(group["params"], sources)
    if model_parameters is not None:
        model_parameters = [{**g, "params": _remap(g["params"], sources)} if isinstance(g, dict) else g
                            for g in _remap(list(model_parameters), sources)]
    return model, model_parameters


def _remap(params: list, sources: dict[int, list]) -> list:
    out = []
    for p in params:
        out += sources.get(id(p), [p]) if isinstance(p, torch.Tensor) else [p]
    return out
