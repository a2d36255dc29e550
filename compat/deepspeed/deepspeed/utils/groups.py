"""``deepspeed.utils.groups``: DeepSpeed's accessors of the tensor / model / data-parallel, sequence-parallel
and expert groups, as views of the active grid (``shardwise.topology.active_grid``: the grid ``initialize``
activated, or the one of a ``with grid.active():`` scope). The groups themselves are the grid's
(``shardwise.topology``); nothing here creates one.

As in DeepSpeed's module (which AutoTP fills), ``get_model_parallel_*`` here means the tensor axis; the
grid's own ``get_model_parallel_*`` means pipe x tensor, as DeepSpeed's pipeline grid. Without a grid:
tensor size 1 and data parallelism over every rank. Without a sequence axis (``register_with_transformers``
lays one out) sequence parallelism is off: size 1, rank 0, and the sequence-data-parallel group is every
rank. The expert groups are named ``ep_size_N`` as DeepSpeed names them.
"""

from __future__ import annotations

from shardwise import comm
from shardwise import topology as _topology

__all__ = ["get_tensor_model_parallel_group", "get_tensor_model_parallel_world_size",
           "get_tensor_model_parallel_rank", "get_tensor_model_parallel_src_rank", "get_model_parallel_group",
           "get_model_parallel_world_size", "get_model_parallel_rank", "get_data_parallel_group",
           "get_data_parallel_world_size", "get_data_parallel_rank"]


def _grid():
    return _topology.active_grid()


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


# -- sequence parallelism: the active grid's sequence axis ------------------------------------------------
def _sequence_grid():
    grid = _grid()
    return grid if grid is not None and grid.size("sequence") > 1 else None


def _world_if_none(group):
    return comm.get_world_group() if group is None else group


def _get_sequence_parallel_group():
    grid = _sequence_grid()
    if grid is None:
        raise KeyError("No sequence parallel group found: call UlyssesSPAttentionHF.register_with_transformers first")
    return _world_if_none(grid.group("sequence"))


def _get_sequence_parallel_world_size() -> int:
    grid = _sequence_grid()
    return 1 if grid is None else grid.size("sequence")


def _get_sequence_parallel_rank() -> int:
    grid = _sequence_grid()
    return 0 if grid is None else grid.axis_rank("sequence")


def _get_sequence_data_parallel_group():
    grid = _sequence_grid()
    return comm.get_world_group() if grid is None else _world_if_none(grid.group("sequence_data"))


def _get_sequence_data_parallel_world_size() -> int:
    grid = _sequence_grid()
    return comm.get_world_size() if grid is None else grid.size("sequence_data")


def _get_sequence_data_parallel_rank() -> int:
    grid = _sequence_grid()
    return comm.get_rank() if grid is None else grid.axis_rank("sequence_data")


# -- mixture of experts: the grid's expert groups by DeepSpeed's names ("ep_size_N") ----------------------
def _ep_size(group_name: str) -> int:
    return int(str(group_name).removeprefix("ep_size_"))


def _experts(group_name: str):
    made = _topology.created_expert_groups().get(_ep_size(group_name)) if str(group_name).startswith(
        "ep_size_") else None
    if made is None:
        raise KeyError(f"expert parallel group {group_name!r} is not created: the engine creates it for the "
                       "MoE layers of its model (or call MoE.set_deepspeed_parallelism())")
    return made


def _get_expert_parallel_ranks(world_size: int, tensor_parallel_size_: int, expert_parallel_size_: int,
                               pipeline_parallel_size_: int = 1, use_data_before_expert_parallel_: bool = False):
    """DeepSpeed's rank arithmetic (no groups are created): the expert-parallel and expert-data-parallel
    rank lists of a (pipe, data, tensor) layout, data group by data group."""
    return _topology.expert_rank_lists(world_size, tensor_parallel_size_, expert_parallel_size_,
                                       pipeline_parallel_size_, use_data_before_expert_parallel_)


def _create_expert_and_data_parallel(expert_parallel_size_: int, mp_size=None, pp_size=None, mp_mode: str = "tp",
                                     use_data_before_expert_parallel_: bool = False, folding_spec=None):
    """The active grid's groups of ``ep_size_{expert_parallel_size_}`` (created there on first use; collective).
    The grid's layout decides the rank order (tensor-strided, as DeepSpeed's ``mp_mode="tp"``): ``mp_size``,
    ``pp_size`` and ``mp_mode`` are read off it, not passed."""
    if folding_spec is not None:
        raise NotImplementedError("_create_expert_and_data_parallel(folding_spec=...): AutoEP+AutoTP folding tables "
                                  "are not supported by shardwise")
    _topology.expert_groups(expert_parallel_size_, data_before_expert=use_data_before_expert_parallel_)


def _get_expert_parallel_group(group_name: str):
    return _experts(group_name).group


def _get_expert_data_parallel_group(group_name: str):
    return _experts(group_name).data_group


def _get_expert_parallel_group_dict() -> dict:
    return {f"ep_size_{ep}": g.group for ep, g in _topology.created_expert_groups().items()}


def _get_expert_data_parallel_group_dict() -> dict:
    return {f"ep_size_{ep}": g.data_group for ep, g in _topology.created_expert_groups().items()}


def _get_expert_parallel_group_ranks(group_name: str) -> list[int]:
    return list(_experts(group_name).ranks)


def _get_expert_data_parallel_group_ranks(group_name: str) -> list[int]:
    return list(_experts(group_name).data_ranks)


def _get_expert_parallel_world_size(group_name: str) -> int:
    return _experts(group_name).size


def _get_expert_data_parallel_world_size(group_name: str) -> int:
    return _experts(group_name).data_size


def _get_expert_parallel_rank(group_name: str) -> int:
    return _experts(group_name).rank


def _get_expert_data_parallel_rank(group_name: str) -> int:
    return _experts(group_name).data_rank


def _get_expert_parallel_src_rank(group_name: str) -> int:
    """The global rank of the first rank of this rank's expert-parallel group."""
    return _experts(group_name).ranks[0]


def _get_expert_broadcast_src_rank(group_name: str) -> int:
    """The global rank every expert-data-parallel replica of this rank's experts copies at start."""
    return _experts(group_name).data_ranks[0]


def _get_max_expert_size() -> int:
    return max(_topology.created_expert_groups(), default=1)


def _get_max_expert_size_name() -> str:
    return f"ep_size_{_get_max_expert_size()}"


def _get_max_expert_parallel_group():
    return _get_expert_parallel_group(_get_max_expert_size_name())


def _get_expert_model_parallel_world_size() -> int:
    return 1  # tensor-parallel experts are not implemented
