"""The layout of a model with MoE layers: expert parameters reduce over their expert-data-parallel group.

Each MoE layer's experts are split over the ``ep_size`` ranks of its expert-parallel group; every expert
has ``data / ep_size`` replicas, its expert-data-parallel group. The ZeRO strategy lays the expert
parameters of each such group out in buffers of their own (a ``ReduceDomain``), reduced and partitioned
over that group; the rest over the data axis. One strategy and one optimizer step all of them.

Gradient scale, as DeepSpeed: an expert's gradient is averaged over the *whole* data axis (so the result
does not depend on ``ep_size``). Its owner already holds the sum over the ``ep_size`` ranks of its
expert-parallel group (the all-to-all's backward brought their tokens' gradients) and the reduction
averages over the ``data / ep_size`` ranks of the expert-data-parallel group, so the domain's reduced
gradient is scaled by ``1 / ep_size`` (times the tensor ranks sharing each expert's slots: each saw
``1 / tensor`` of the tokens).

Gradient norm: partitioned stages hold disjoint shares over the data axis (dense) and over expert-parallel
x expert-data-parallel = the data axis (experts), so the norm's sum over the data axis counts each element
once; a replicated stage holds its own experts' whole gradients, so an expert domain's sum is first summed
over its expert-parallel group (``ReduceDomain.norm_group``).

Checkpoints name each expert by its global index (local expert ``j`` of expert-parallel rank ``r`` is
``r * num_local_experts + j``), as DeepSpeed's files do; a whole-module state dict gathers every expert.
"""

from __future__ import annotations

import torch

from shardwise import comm
from shardwise.moe.utils import is_moe_layer, is_moe_param, moe_layers
from shardwise.zero.layout import ParamLayout, ReduceDomain


def _expert_blocks(module: torch.nn.Module):
    """``(prefix of the layer's expert list, layer)`` for every MoE layer (DeepSpeed's ``MoE`` or an
    AutoEP block), e.g. ``("moe.deepspeed_moe.experts.deepspeed_experts.", layer)``."""
    for name, m in module.named_modules():
        if is_moe_layer(m):
            yield f"{name + '.' if name else ''}{m.local_experts_path}.", m


def _expert_offset(layer) -> int:
    return 0 if layer.ep_size == 1 else layer.expert_groups.rank * layer.num_local_experts


def global_expert_names(module: torch.nn.Module) -> dict[str, str]:
    """``{local state-dict name: global name}`` for this rank's experts: local expert ``j`` of a layer is
    global expert ``ep_rank * num_local_experts + j`` (only names that differ are listed)."""
    out = {}
    for prefix, layer in _expert_blocks(module):
        offset = _expert_offset(layer)
        if offset:
            for key in layer.get_submodule(layer.local_experts_path).state_dict(keep_vars=True):
                j, rest = key.split(".", 1)
                out[prefix + key] = f"{prefix}{offset + int(j)}.{rest}"
    return out


class ExpertLayout(ParamLayout):
    """Dense parameters over the data group; each expert group's parameters over its expert-data-parallel
    group (unless that group is the data group itself: ``ep_size`` 1 without tensor parallelism)."""

    has_experts = True

    def __init__(self, module: torch.nn.Module, dp_group=None) -> None:
        super().__init__(dp_group)
        self.module = module
        self.groups = {layer.expert_group_name: layer.expert_groups for layer in moe_layers(module)}
        dp = sorted(torch.distributed.get_process_group_ranks(dp_group)) if dp_group is not None else \
            list(range(comm.get_world_size()))
        self._own_domain = {name: sorted(g.data_ranks) != dp for name, g in self.groups.items()}
        self.scales: dict[int, float] = {}  # id(expert parameter) -> its reduced gradient's scale
        for layer in moe_layers(module):
            for p in layer.get_submodule(layer.local_experts_path).parameters():
                self.scales[id(p)] = getattr(layer, "expert_grad_scale", 1.0 / layer.ep_size)
        self.saved_names = global_expert_names(module)
        mine, every = set(), set()
        for prefix, layer in _expert_blocks(module):
            offset = _expert_offset(layer)
            for key in layer.get_submodule(layer.local_experts_path).state_dict(keep_vars=True):
                j, rest = key.split(".", 1)
                mine.add(f"{prefix}{offset + int(j)}.{rest}")
                every.update(f"{prefix}{g}.{rest}" for g in range(layer.num_experts))
        self.held_elsewhere = frozenset(every - mine)  # experts of the other expert-parallel ranks
        local = {n for n, p in module.named_parameters() if is_moe_param(p)}
        self.expert_names = frozenset(local | {self.saved_names[n] for n in local if n in self.saved_names})

    def _domain_name(self, p: torch.nn.Parameter) -> str | None:
        if is_moe_param(p) and self._own_domain.get(p.group_name, False):
            return p.group_name
        return None

    def named(self, named_params):
        return [(self.saved_names.get(n, n), p) for n, p in named_params]

    def domains(self, named_params):
        by: dict[tuple, list] = {}
        for name, p in named_params:
            key = self._domain_name(p)
            scale = self.scales.get(id(p), 1.0) if key is not None else 1.0
            by.setdefault((key, scale), []).append((name, p))
        out = []
        for (key, scale), params in sorted(by.items(), key=lambda kv: (kv[0][0] is not None, kv[0][0] or "", kv[0][1])):
            if key is None:
                out.append((ReduceDomain.of(self.dp_group), params))
                continue
            g = self.groups[key]
            out.append((ReduceDomain.of(g.data_group, name=key, grad_scale=scale,
                                        norm_group=g.group if g.size > 1 else None), params))
        if not any(d.name is None for d, _ in out):  # (an empty dense domain: no buffers, but it is the data group)
            out.insert(0, (ReduceDomain.of(self.dp_group), []))
        return out

    def partition_group(self, p):
        key = self._domain_name(p)
        return self.dp_group if key is None else self.groups[key].data_group

    def grad_scale(self, p) -> float:
        return self.scales.get(id(p), 1.0) if self._domain_name(p) is not None else 1.0

    def whole_state(self, module, state):
        """Every expert of every expert-parallel rank, by global index (collective over each expert group)."""
        state = dict(state)
        for prefix, layer in _expert_blocks(module):
            keys = layer.get_submodule(layer.local_experts_path).state_dict(keep_vars=True)
            local = {key: state.pop(prefix + key) for key in keys}
            group = layer.expert_groups.group if layer.ep_size > 1 else None
            for key, t in local.items():
                j, rest = key.split(".", 1)
                pieces = [t.detach()]
                if group is not None:
                    pieces = [torch.empty_like(t) for _ in range(layer.ep_size)]
                    comm.all_gather(pieces, t.detach().contiguous(), group=group)
                for r, piece in enumerate(pieces):
                    state[f"{prefix}{r * layer.num_local_experts + int(j)}.{rest}"] = piece
        return state

    def local_state(self, state):
        """``state`` names experts globally: this rank's are kept under their local names, the rest skipped."""
        local_of = {g: n for n, g in self.saved_names.items()}
        return {local_of.get(key, key): value for key, value in state.items() if key not in self.held_elsewhere}
