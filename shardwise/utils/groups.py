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
from shardwise.topology import active_grid

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
