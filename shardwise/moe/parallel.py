"""What the engine does for a model with MoE layers: create the expert groups, start every replica of an
expert from one copy, and build the ZeRO strategy that reduces expert gradients over the
expert-data-parallel group and the rest over the whole data axis.

Gradient scale, as DeepSpeed: an expert's gradient is averaged over the *whole* data axis (so the result
does not depend on ``ep_size``). Its owner already holds the sum over the ``ep_size`` ranks of its
expert-parallel group (the all-to-all's backward brought their tokens' gradients), the reduction over
the expert-data-parallel group averages over ``data / ep_size`` ranks; a hook on each expert parameter
divides the incoming gradient by ``ep_size`` first.

The strategy (``ExpertSplitStrategy``) holds one ordinary ZeRO strategy for the dense parameters (over
the data axis) and one per expert group (over its expert-data-parallel group). Each steps its own copy of
the user's optimizer holding just its parameters; the copies share the user's optimizer's ``state`` dict
(checkpoints read it there) and follow its groups' hyper-parameters (a scheduler changing the learning
rate there changes it for the experts too).
"""

from __future__ import annotations

import torch

from shardwise import comm
from shardwise.moe.utils import is_moe_layer, is_moe_param, moe_layers
from shardwise.optim.muon import Muon
from shardwise.parallel_dims import ParallelDims, check_rule
from shardwise.topology import active_grid, expert_groups
from shardwise.zero.strategy import ZeroStrategy


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
    """Create the groups of every MoE layer (collective) and arm the gradient pre-division. ``across_stages``:
    the groups of every stage's layers are created on every rank (process groups are created by the whole
    world), this stage's layers then take theirs."""
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
        # shared each of them saw 1 / tensor of the tokens: the gradient is scaled by shared / ep_size first
        scale = shared / layer.ep_size
        if scale == 1:
            continue
        for p in layer.get_submodule(layer.local_experts_path).parameters():
            if not getattr(p, "_shardwise_ep_divided", False) and p.requires_grad:
                p.register_hook(lambda g, c=scale: g * c)
                p._shardwise_ep_divided = True


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


def build_strategy(build, *, module, named_params, optimizer, dp_group, zero_stage: int = 0) -> ZeroStrategy:
    """``build(named_params=, optimizer=, dp_group=)`` makes one ordinary strategy; split when an
    expert-data-parallel group is not the data axis (an ``ep_size`` above 1, or tensor parallelism). ZeRO-3
    is not split: one strategy shards each expert parameter within its expert-data-parallel group
    (``partition_group``), the rest over the data axis."""
    by_group: dict[str, list] = {}
    dense = []
    experts = experts_by_name(module)
    for name, p in named_params:
        if is_moe_param(p) and not _reduced_over(p, dp_group, experts):
            by_group.setdefault(p.group_name, []).append((name, p))
        else:
            dense.append((name, p))
    if not by_group:
        return build(named_params=named_params, optimizer=optimizer, dp_group=dp_group)
    if zero_stage == 3:  # (fragments name each expert by its global index, as below)
        names = global_expert_names(module)
        named_params = [(names.get(n, n), p) for n, p in named_params]
        strategy = build(named_params=named_params, optimizer=optimizer, dp_group=dp_group,
                         partition_group=lambda p: partition_group(p, dp_group, experts))
        return ExpertZero3Strategy([_Part(None, strategy, [], 1, names={n for n, _ in named_params})],
                                   optimizer=optimizer, module=module)
    if optimizer is None:
        raise ValueError("expert parallelism needs an optimizer in the config or passed to initialize()")
    if isinstance(optimizer, Muon):  # Muon assembles each matrix over one data group, not per part
        check_rule("muon_experts", ParallelDims(muon=True, moe=True, expert=expert_parallel_size(module),
                                                tensor=_tensor_size()))
    names = global_expert_names(module)
    parts = []
    for group_name, params in [(None, dense)] + sorted(by_group.items()):
        if group_name is not None and not any(p.requires_grad for _, p in params):
            continue
        if group_name is not None:  # fragments (checkpoints) name each expert by its global index
            params = [(names.get(n, n), p) for n, p in params]
        sub, links = _sub_optimizer(optimizer, {id(p) for _, p in params})
        mine = None if group_name is None else experts[group_name]
        group = dp_group if mine is None else mine.data_group
        ep = 1 if mine is None else mine.size
        parts.append(_Part(group_name, build(named_params=params, optimizer=sub, dp_group=group), links, ep,
                           names={n for n, _ in params}, ep_group=None if mine is None else mine.group))
    return ExpertSplitStrategy(parts, optimizer=optimizer, module=module)


def _reduced_over(p: torch.nn.Parameter, dp_group, experts: dict) -> bool:
    """Whether expert parameter ``p``'s expert-data-parallel group is ``dp_group`` itself (``ep_size`` 1
    without tensor parallelism): then it is reduced and partitioned as a dense parameter."""
    edp = sorted(experts[p.group_name].data_ranks)
    dp = sorted(torch.distributed.get_process_group_ranks(dp_group)) if dp_group is not None else \
        list(range(comm.get_world_size()))
    return edp == dp


def partition_group(p: torch.nn.Parameter, dp_group, experts: dict):
    """The group ZeRO-3 shards ``p`` over: an expert parameter (DeepSpeed's tagging: ``allreduce`` False,
    ``group_name``) its expert-data-parallel group, any other the data axis."""
    if is_moe_param(p) and not _reduced_over(p, dp_group, experts):
        return experts[p.group_name].data_group
    return dp_group


def _expert_blocks(module: torch.nn.Module):
    """``(prefix of the layer's expert list, layer)`` for every MoE layer (DeepSpeed's ``MoE`` or an
    AutoEP block), e.g. ``("moe.deepspeed_moe.experts.deepspeed_experts.", layer)``."""
    for name, m in module.named_modules():
        if is_moe_layer(m):
            yield f"{name + '.' if name else ''}{m.local_experts_path}.", m


def _expert_offset(layer) -> int:
    if layer.ep_size == 1:
        return 0
    return layer.expert_groups.rank * layer.num_local_experts


def global_expert_names(module: torch.nn.Module) -> dict[str, str]:
    """``{local state-dict name: global name}`` for this rank's experts: local expert ``j`` of a layer is
    global expert ``ep_rank * num_local_experts + j`` (only names that differ are listed)."""
    out = {}
    for prefix, layer in _expert_blocks(module):
        offset = _expert_offset(layer)
        for key in layer.get_submodule(layer.local_experts_path).state_dict(keep_vars=True):
            j, rest = key.split(".", 1)
            if offset:
                out[prefix + key] = f"{prefix}{offset + int(j)}.{rest}"
    return out


class _Part:
    """One expert group's (or, ``group_name`` None, the dense parameters') strategy and optimizer links."""

    def __init__(self, group_name, strategy, links, ep_size, *, names: set[str], ep_group=None) -> None:
        self.group_name, self.strategy, self.links, self.ep_size = group_name, strategy, links, ep_size
        self.names = names  # the parameter names it holds (experts: global names)
        self.ep_group = ep_group  # the expert-parallel group (None: the dense part)

    def follow_hyperparameters(self) -> None:
        for user_group, own in self.links:
            for key, value in user_group.items():
                if key != "params":
                    own[key] = value


def _sub_optimizer(optimizer: torch.optim.Optimizer, keep: set[int]):
    """A copy of ``optimizer`` (same class, settings and state dict) holding only the parameters in
    ``keep``; with the pairs (user's group, copy's group) whose hyper-parameters the copy follows."""
    sub = object.__new__(type(optimizer))
    sub.__dict__.update(optimizer.__dict__)
    sub.param_groups, links = [], []
    sub.state = optimizer.state  # one state dict: checkpoints read and load it through the user's optimizer
    for g in optimizer.param_groups:
        params = [p for p in g["params"] if id(p) in keep]
        if params:
            own = {**g, "params": params}
            sub.param_groups.append(own)
            links.append((g, own))
    return sub, links


class ExpertSplitStrategy(ZeroStrategy):
    """The dense strategy plus one per expert group; the engine sees one strategy."""

    def __init__(self, parts: list[_Part], *, optimizer, module) -> None:
        self.parts = parts
        self.saved_names = global_expert_names(module)  # {local name: global name} (checkpoints)
        mine, every = set(), set()
        for prefix, layer in _expert_blocks(module):
            offset = _expert_offset(layer)
            for key in layer.get_submodule(layer.local_experts_path).state_dict(keep_vars=True):
                j, rest = key.split(".", 1)
                mine.add(f"{prefix}{offset + int(j)}.{rest}")
                every.update(f"{prefix}{g}.{rest}" for g in range(layer.num_experts))
        self.held_elsewhere = every - mine  # experts of the other expert-parallel ranks (global names)
        dense = parts[0].strategy
        self.dense = dense
        self.optimizer = optimizer  # the user's: the scheduler and get_lr() read its groups
        self.stage, self.replicated = dense.stage, dense.replicated
        self.shards_gradients, self.shards_parameters = dense.shards_gradients, dense.shards_parameters
        self.gathers_module_state = True  # the experts of the other expert-parallel ranks are gathered
        self.dp_group, self.dp_world_size = dense.dp_group, dense.dp_world_size
        self.precision = getattr(dense, "precision", None)

    @property
    def strategies(self) -> list[ZeroStrategy]:
        return [p.strategy for p in self.parts]

    @property
    def reduce_gradients(self) -> bool:
        return self.dense.reduce_gradients

    @reduce_gradients.setter
    def reduce_gradients(self, on: bool) -> None:
        for s in self.strategies:
            s.reduce_gradients = on

    @property
    def can_keep_local_gradients(self) -> bool:
        return all(s.can_keep_local_gradients for s in self.strategies)

    def prepare_backward(self, *, boundary: bool, no_sync: bool = False) -> None:
        for s in self.strategies:
            s.prepare_backward(boundary=boundary, no_sync=no_sync)

    def finish_backward(self) -> None:
        for s in self.strategies:
            s.finish_backward()

    @property
    def norm_is_local(self) -> bool:
        return self.dense.norm_is_local

    def local_grad_norm_sq(self, *, counted=None) -> torch.Tensor:
        """Replicated (stage 0): every rank holds its experts' whole gradients, the other experts are on
        the other ranks of its expert-parallel group: their sums are added here, so the result is the
        whole model's on every rank. Partitioned: each rank's shares are disjoint over the data axis
        (dense) and over expert-parallel x expert-data-parallel = the data axis (experts)."""
        total = self.dense.local_grad_norm_sq(counted=counted)
        for part in self.parts[1:]:
            sq = part.strategy.local_grad_norm_sq(counted=counted).to(total.device, torch.float32)
            if self.norm_is_local and part.ep_size > 1:
                comm.all_reduce(sq, group=part.ep_group)
            total = total + sq
        return total

    def apply_step(self, *, coef: float, coef_fixed: bool = False) -> None:
        for part in self.parts:
            part.follow_hyperparameters()
            part.strategy.apply_step(coef=coef, coef_fixed=coef_fixed)

    def zero_grad(self) -> None:
        for s in self.strategies:
            s.zero_grad()

    # -- checkpoints: experts under their global index ------------------------------------------
    def module_state_dict(self, module):
        """The whole module with every expert (collective: gathered over each expert-parallel group)."""
        state = self.dense.module_state_dict(module)
        for prefix, layer in _expert_blocks(module):
            keys = layer.get_submodule(layer.local_experts_path).state_dict(keep_vars=True)
            local = {key: state.pop(prefix + key) for key in keys}  # (ZeRO-3: gathered by the dense part)
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

    def load_module_state_dict(self, module, state) -> None:
        """``state`` names experts globally: this rank's are loaded into its local ones, the rest skipped."""
        local_of = {g: n for n, g in self.saved_names.items()}
        own = {local_of.get(key, key): value for key, value in state.items() if key not in self.held_elsewhere}
        self.dense.load_module_state_dict(module, own)

    def saved_here(self, name: str) -> bool:
        """Whether this rank writes the fragments of ``name`` (a replicated part: its first replica)."""
        for part in self.parts[1:]:
            if name in part.names:
                return not part.strategy.replicated or comm.get_rank(part.strategy.dp_group) == 0
        return not self.dense.replicated or comm.get_rank(self.dense.dp_group) == 0

    def local_fragments(self):
        for s in self.strategies:
            yield from s.local_fragments()

    def local_grad(self, name: str, start: int, end: int) -> torch.Tensor:
        for s in self.strategies:
            if any(f[0] == name for f in s.local_fragments()):
                return s.local_grad(name, start, end)
        raise KeyError(name)

    def memory_parts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for s in self.strategies:
            for k, v in s.memory_parts().items():
                out[k] = out.get(k, 0) + v
        return out


class ExpertZero3Strategy(ExpertSplitStrategy):
    """ZeRO-3 with expert parallelism: one stage-3 strategy whose units are sharded over their own groups
    (expert units within their expert-data-parallel group); this wrapper only names the experts globally
    in checkpoints and whole-model state dicts, and answers everything else as the stage-3 strategy.

    Gradient norm: each rank's shard of a dense parameter is disjoint from the other data ranks', and an
    expert's shards are disjoint over its expert-data-parallel group while the expert-parallel ranks hold
    different experts, so the sum over the data axis counts every parameter once."""

    def __getattr__(self, name):
        if name.startswith("__") or name in ("parts", "dense"):
            raise AttributeError(name)
        return getattr(self.dense, name)
