"""``deepspeed.utils.groups``: the tensor / model / data-parallel groups of the active grid
(``shardwise.topology.active_grid``: the grid ``initialize`` activated, or the one of a ``with grid.active():`` scope), and the
sequence-parallel accessors DeepSpeed's ALST examples call.

As in DeepSpeed's module (which AutoTP fills), ``get_model_parallel_*`` here means the tensor
axis; the grid's own ``get_model_parallel_*`` means pipe x tensor, as DeepSpeed's pipeline grid.
Without a grid: tensor size 1 and data parallelism over every rank.

The ``_get_sequence_*`` functions answer from the groups ``UlyssesSPAttentionHF.register_with_transformers``
created (``shardwise.runtime.sequence_parallel.parallel_state_sp``); without them sequence parallelism
is off: size 1, rank 0, and the sequence-data-parallel group is every rank.
"""

from __future__ import annotations

from shardwise import comm
from shardwise.topology import PipeModelDataParallelTopology, active_grid

__all__ = ["get_tensor_model_parallel_group", "get_tensor_model_parallel_world_size",
           "get_tensor_model_parallel_rank", "get_tensor_model_parallel_src_rank", "get_model_parallel_group",
           "get_model_parallel_world_size", "get_model_parallel_rank", "get_data_parallel_group",
           "get_data_parallel_world_size", "get_data_parallel_rank"]


def _grid():
    return active_grid()


def get_tensor_model_parallel_group():
    grid = _grid()
    return grid.get_tensor_model_parallel_group() if grid is not None else None


def get_tensor_model_parallel_world_size() -> int:
    grid = _grid()
    return grid.get_tensor_model_parallel_world_size() if grid is not None else 1


def get_tensor_model_parallel_rank() -> int:
    grid = _grid()
    return grid.get_tensor_model_parallel_rank() if grid is not None else 0


def get_tensor_model_parallel_src_rank() -> int:
    grid = _grid()
    return grid.get_tensor_model_parallel_src_rank() if grid is not None else comm.get_rank()


get_model_parallel_group = get_tensor_model_parallel_group
get_model_parallel_world_size = get_tensor_model_parallel_world_size
get_model_parallel_rank = get_tensor_model_parallel_rank


def get_data_parallel_group():
    grid = _grid()
    return grid.get_data_parallel_group() if grid is not None else None


def get_data_parallel_world_size() -> int:
    grid = _grid()
    return grid.get_data_parallel_world_size() if grid is not None else comm.get_world_size()


def get_data_parallel_rank() -> int:
    grid = _grid()
    return grid.get_data_parallel_rank() if grid is not None else comm.get_rank()


_get_data_parallel_group = get_data_parallel_group
_get_data_parallel_world_size = get_data_parallel_world_size
_get_data_parallel_rank = get_data_parallel_rank
_get_model_parallel_world_size = get_model_parallel_world_size


def _sp():
    from shardwise.runtime.sequence_parallel import parallel_state_sp

    return parallel_state_sp if parallel_state_sp.is_initialized() else None


def _get_sequence_parallel_group():
    sp = _sp()
    if sp is None:
        raise KeyError("No sequence parallel group found: call UlyssesSPAttentionHF.register_with_transformers first")
    return sp.get_sequence_parallel_group()


def _get_sequence_parallel_world_size() -> int:
    sp = _sp()
    return 1 if sp is None else sp.get_sequence_parallel_world_size()


def _get_sequence_parallel_rank() -> int:
    sp = _sp()
    return 0 if sp is None else sp.get_sequence_parallel_rank()


def _get_sequence_data_parallel_group():
    sp = _sp()
    return comm.get_world_group() if sp is None else sp.get_sequence_data_parallel_group()


def _get_sequence_data_parallel_world_size() -> int:
    sp = _sp()
    return comm.get_world_size() if sp is None else sp.get_sequence_data_parallel_world_size()


def _get_sequence_data_parallel_rank() -> int:
    sp = _sp()
    return comm.get_rank() if sp is None else sp.get_sequence_data_parallel_rank()


# -- mixture of experts: the expert-parallel and expert-data-parallel groups, by name ("ep_size_N") -----
# Cut from the data axis of the active grid (DeepSpeed's layout): with data ranks d_0..d_{D-1} and
# expert-parallel size E, the expert-parallel groups are consecutive blocks [d_0..d_{E-1}], ... (tokens
# are exchanged within one), the expert-data-parallel groups strided ones [d_0, d_E, ...], ... (expert
# gradients are reduced over one). Forgotten when the process group is destroyed.
_EXPERT_PARALLEL_GROUP: dict = {}
_EXPERT_PARALLEL_GROUP_RANKS: dict = {}
_EXPERT_DATA_PARALLEL_GROUP: dict = {}
_EXPERT_DATA_PARALLEL_GROUP_RANKS: dict = {}
_EXPERT_LAYOUT: dict = {}  # name -> every (expert-parallel, expert-data-parallel) rank list the groups were cut to


def _forget_expert_groups() -> None:
    for d in (_EXPERT_PARALLEL_GROUP, _EXPERT_PARALLEL_GROUP_RANKS, _EXPERT_DATA_PARALLEL_GROUP,
              _EXPERT_DATA_PARALLEL_GROUP_RANKS, _EXPERT_LAYOUT):
        d.clear()


comm.on_destroy(_forget_expert_groups)


def _data_axis_rank_lists() -> list[list[int]]:
    """Every data-parallel group's ranks: from the active grid's topology, or (a user's mpu) gathered."""
    grid = _grid()
    if grid is None:
        return [list(range(comm.get_world_size()))]
    topology = getattr(grid, "topology", None)
    if topology is not None and "data" in topology.axes:
        return _expert_rank_lists(topology)
    import torch.distributed as dist

    group = grid.get_data_parallel_group()
    mine = dist.get_process_group_ranks(group) if group is not None else list(range(comm.get_world_size()))
    everyone = [None] * comm.get_world_size()
    dist.all_gather_object(everyone, sorted(mine))
    return [list(r) for r in sorted({tuple(r) for r in everyone})]


def _expert_rank_lists(topology) -> list[list[int]]:
    """Per pipeline stage, the ranks experts are split over, in DeepSpeed's order: tensor rank 0's data
    ranks, then tensor rank 1's, ... (TP-strided), each data rank followed by its sequence peers. With
    sequence parallelism every rank routes its own tokens; with tensor parallelism every tensor rank runs
    1 / tensor of each expert's slots. So expert-parallel groups (consecutive blocks) stay within one tensor
    rank, and an expert-data-parallel group spans the tensor ranks."""
    stages: dict[int, list[int]] = {}
    for rank in range(topology.world_size):
        stages.setdefault(topology.get_coord(rank).get("pipe", 0), []).append(rank)

    def order(rank):
        c = topology.get_coord(rank)
        return c.get("model", 0), c.get("data", 0), c.get("sequence", 0)

    return [sorted(ranks, key=order) for _, ranks in sorted(stages.items())]


def _split_data_ranks(data_ranks: list[int], ep: int, data_before_expert: bool):
    """(expert-parallel groups, expert-data-parallel groups) cut from one data-parallel group's ranks."""
    blocks = len(data_ranks) // ep
    if data_before_expert:  # data-parallel replicas are the consecutive blocks instead
        return ([data_ranks[i::blocks] for i in range(blocks)],
                [data_ranks[i * blocks:(i + 1) * blocks] for i in range(ep)])
    return [data_ranks[i * ep:(i + 1) * ep] for i in range(blocks)], [data_ranks[i::ep] for i in range(ep)]


def _get_expert_parallel_ranks(world_size: int, tensor_parallel_size_: int, expert_parallel_size_: int,
                               pipeline_parallel_size_: int = 1, use_data_before_expert_parallel_: bool = False):
    """DeepSpeed's rank arithmetic (no groups are created): the expert-parallel and expert-data-parallel
    rank lists of a (pipe, data, tensor) layout, data group by data group."""
    model = tensor_parallel_size_ * pipeline_parallel_size_
    if world_size % model or (world_size // model) % expert_parallel_size_:
        raise ValueError(f"world size {world_size} with tensor {tensor_parallel_size_} x pipe "
                         f"{pipeline_parallel_size_}: the data-parallel size is not divisible by ep_size "
                         f"{expert_parallel_size_}")
    topology = PipeModelDataParallelTopology(num_pp=pipeline_parallel_size_, num_mp=tensor_parallel_size_,
                                             num_dp=world_size // model)
    ep_all, edp_all = [], []
    for data_ranks in topology.axis_groups("data"):
        ep_groups, edp_groups = _split_data_ranks(data_ranks, expert_parallel_size_, use_data_before_expert_parallel_)
        ep_all += ep_groups
        edp_all += edp_groups
    return ep_all, edp_all


def _create_expert_and_data_parallel(expert_parallel_size_: int, use_data_before_expert_parallel_: bool = False):
    """Create the groups of ``ep_size_{expert_parallel_size_}`` (collective: every rank creates every group)."""
    name = f"ep_size_{expert_parallel_size_}"
    rank, ep = comm.get_rank(), expert_parallel_size_
    layout = []
    for data_ranks in _data_axis_rank_lists():
        if len(data_ranks) % ep:
            raise ValueError(f"MoE ep_size {ep} does not divide the data-parallel size {len(data_ranks)} "
                             f"(data ranks {data_ranks})")
        layout.append(_split_data_ranks(data_ranks, ep, use_data_before_expert_parallel_))
    # Made once per layout: the same every rank computes from the same grid, so every rank agrees whether to
    # create them again (an engine on another grid in the same process: new groups, not the old grid's).
    if _EXPERT_LAYOUT.get(name) == layout:
        return
    _EXPERT_LAYOUT[name] = layout
    for ep_groups, edp_groups in layout:
        for table, ranks_table, lists in ((_EXPERT_DATA_PARALLEL_GROUP, _EXPERT_DATA_PARALLEL_GROUP_RANKS, edp_groups),
                                          (_EXPERT_PARALLEL_GROUP, _EXPERT_PARALLEL_GROUP_RANKS, ep_groups)):
            for ranks in lists:
                group = comm.new_group(ranks)
                if rank in ranks:
                    table[name], ranks_table[name] = group, list(ranks)


def _get_expert_parallel_group(group_name: str):
    if group_name not in _EXPERT_PARALLEL_GROUP:
        raise KeyError(f"expert parallel group {group_name!r} is not created: the engine creates it for the "
                       "MoE layers of its model (or call MoE.set_deepspeed_parallelism())")
    return _EXPERT_PARALLEL_GROUP[group_name]


def _get_expert_data_parallel_group(group_name: str):
    if group_name not in _EXPERT_DATA_PARALLEL_GROUP:
        raise KeyError(f"expert data parallel group {group_name!r} is not created")
    return _EXPERT_DATA_PARALLEL_GROUP[group_name]


def _get_expert_parallel_group_dict() -> dict:
    return _EXPERT_PARALLEL_GROUP


def _get_expert_data_parallel_group_dict() -> dict:
    return _EXPERT_DATA_PARALLEL_GROUP


def _get_expert_parallel_group_ranks(group_name: str) -> list[int]:
    return _EXPERT_PARALLEL_GROUP_RANKS[group_name]


def _get_expert_data_parallel_group_ranks(group_name: str) -> list[int]:
    return _EXPERT_DATA_PARALLEL_GROUP_RANKS[group_name]


def _get_expert_parallel_world_size(group_name: str) -> int:
    return comm.get_world_size(_get_expert_parallel_group(group_name))


def _get_expert_data_parallel_world_size(group_name: str) -> int:
    return comm.get_world_size(_get_expert_data_parallel_group(group_name))


def _get_expert_parallel_rank(group_name: str) -> int:
    return comm.get_rank(_get_expert_parallel_group(group_name))


def _get_expert_data_parallel_rank(group_name: str) -> int:
    return comm.get_rank(_get_expert_data_parallel_group(group_name))


def _get_expert_parallel_src_rank(group_name: str) -> int:
    """The global rank of the first rank of this rank's expert-parallel group."""
    return _EXPERT_PARALLEL_GROUP_RANKS[group_name][0]


def _get_expert_broadcast_src_rank(group_name: str) -> int:
    """The global rank every expert-data-parallel replica of this rank's experts copies at start."""
    return _EXPERT_DATA_PARALLEL_GROUP_RANKS[group_name][0]


def _get_max_expert_size() -> int:
    return max((int(n.removeprefix("ep_size_")) for n in _EXPERT_PARALLEL_GROUP), default=1)


def _get_max_expert_size_name() -> str:
    return f"ep_size_{_get_max_expert_size()}"


def _get_max_expert_parallel_group():
    return _get_expert_parallel_group(_get_max_expert_size_name())


def _get_expert_model_parallel_world_size() -> int:
    return 1  # tensor-parallel experts are not implemented
