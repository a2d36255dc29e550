"""What the engine does for a model with MoE layers: create the expert groups, start every replica of an
expert from one copy, and hand the ZeRO strategy the layout (``shardwise/moe/layout.py: ExpertLayout``)
that reduces expert gradients over the expert-data-parallel group and the rest over the whole data axis.
"""

from __future__ import annotations

import torch

from shardwise import comm
from shardwise.moe.layout import ExpertLayout, global_expert_names  # noqa: F401 (global_expert_names: re-exported)
from shardwise.moe.utils import is_moe_param, moe_layers
from shardwise.optim.muon import Muon
from shardwise.parallel_dims import ParallelDims, check_rule
from shardwise.topology import active_grid, expert_groups


def expert_parallel_size(model: torch.nn.Module) -> int:
    """The largest ``ep_size`` of the model's MoE layers (1 without any): the grid's expert axis."""
    return max((layer.ep_size for layer in moe_layers(model)), default=1)


def expert_parallel_sizes(model: torch.nn.Module, *, across_stages: bool = False) -> list[int]:
    """The ``ep_size`` of every MoE layer of ``model``, sorted. ``across_stages`` (a pipeline: each stage builds
    only its own layers): of every stage's, gathered over the world (collective), so that every rank sees the
    same sizes, refuses the same combinations and creates the same groups."""
    sizes = {layer.ep_size for layer in moe_layers(model)}
    world = comm.get_world_size()
    if across_stages and world > 1:
        used = torch.zeros(world + 1, dtype=torch.int32)  # used[n]: some rank has a layer of ep_size n
        used[[n for n in sizes if n <= world]] = 1
        comm.all_reduce(used, op=torch.distributed.ReduceOp.MAX)
        sizes |= {int(n) for n in used.nonzero().flatten()}
    return sorted(sizes)


def configure(module: torch.nn.Module, *, across_stages: bool = False) -> None:
    """Create the groups of every MoE layer (collective) and record the scale of its experts' reduced
    gradients (``expert_grad_scale``, read by the layout). ``across_stages``: the groups of every stage's
    layers are created on every rank (process groups are created by the whole world), this stage's layers
    then take theirs."""
    if across_stages:
        for size in expert_parallel_sizes(module, across_stages=True):  # (ep_size 1 too: its groups are made
            expert_groups(size)  # by the whole world, like the others)
    grid = active_grid()
    tp = grid.size("model") if grid is not None else 1
    for layer in moe_layers(module):
        layer.set_deepspeed_parallelism()
        shared = 1  # how many tensor ranks share each expert's slots
        if tp > 1:
            shared = _share_slots(layer, tp, grid.group("model"))
        # the expert-data-parallel reduction averages over (data / ep_size) x tensor ranks; with the slots
        # shared each of them saw 1 / tensor of the tokens: the reduced gradient is scaled by shared / ep_size
        layer.expert_grad_scale = shared / layer.ep_size


def _share_slots(layer, tp: int, tp_group) -> int:
    """Under tensor parallelism: the tensor ranks share every expert's slots (DeepSpeed's ``MoE``: returns
    ``tp``), or, a block that cannot (AutoEP's), each runs all of them at ``ep_size`` 1 (returns 1)."""
    inner = getattr(layer, "deepspeed_moe", layer)  # DeepSpeed's MoE keeps its token exchange there
    if hasattr(inner, "_set_tp_group"):
        inner._set_tp_group(tp_group, tp)
        return tp
    check_rule("experts_tensor", ParallelDims(expert=layer.ep_size, tensor=tp, moe=True,
                                              experts_unsplit_by_tensor=True), block=type(layer).__name__)
    return 1


def _tensor_size() -> int:
    grid = active_grid()
    return grid.size("model") if grid is not None else 1


def experts_by_name(module: torch.nn.Module) -> dict:
    """``{"ep_size_N": ExpertGroups}`` of the module's MoE layers: the groups each layer took from the grid
    it was configured on (``set_deepspeed_parallelism``)."""
    return {layer.expert_group_name: layer.expert_groups for layer in moe_layers(module)}


def broadcast_experts(module: torch.nn.Module) -> None:
    """Every expert-data-parallel replica of an expert starts from the first one's weights."""
    experts = experts_by_name(module)
    with torch.no_grad():
        for p in module.parameters():
            if is_moe_param(p) and not hasattr(p, "ds_numel") and \
                    experts[p.group_name].data_size > 1:  # (zero.Init: broadcast already)
                mine = experts[p.group_name]
                comm.broadcast(p.data, src=mine.data_ranks[0], group=mine.data_group)


def expert_layout(module: torch.nn.Module, *, dp_group, optimizer=None, zero_stage: int = 0) -> ExpertLayout:
    """The ZeRO layout of a model with MoE layers (``configure`` ran: the layers hold their groups)."""
    layout = ExpertLayout(module, dp_group)
    split = any(d.name is not None for d, _ in layout.domains(module.named_parameters()))
    if split and zero_stage < 3 and isinstance(optimizer, Muon):  # whole matrices over one data group
        check_rule("muon_experts", ParallelDims(muon=True, moe=True, expert=expert_parallel_size(module),
                                                tensor=_tensor_size()))
    return layout
