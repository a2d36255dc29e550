"""``deepspeed.runtime.sequence_parallel.parallel_state_sp``: DeepSpeed's sequence-parallel "mpu" module, as views
of the grid shardwise lays out (``shardwise.runtime.sequence_parallel.groups``).

``initialize_sequence_parallel(N)`` builds and activates the (data, sequence) grid, ranks ``[i*N, (i+1)*N)``
forming sequence-parallel group ``i`` (DeepSpeed's layout). The *sequence-data-parallel* group is every rank of
that grid: ZeRO shards and reduces over it. This module is what DeepSpeed's ``register_with_transformers``
returns and ``initialize(mpu=...)`` takes (registered with ``shardwise.topology.register_grid_view``, so the plan
reads the grid it stands for); like DeepSpeed's it has no ``get_data_parallel_*`` functions.
"""

from __future__ import annotations

import sys

from shardwise import comm
from shardwise.runtime.sequence_parallel import groups as _groups
from shardwise.topology import register_grid_view


def initialize_sequence_parallel(sequence_parallel_size: int, *, tensor_parallel_size: int = 1) -> None:
    """Build the (data x sequence [x tensor]) grid on every rank (collective) and activate it."""
    _groups.sequence_parallel_grid(sequence_parallel_size, tensor_parallel_size=tensor_parallel_size)


def is_initialized() -> bool:
    return _groups.registered_grid() is not None


def get_grid():
    grid = _groups.registered_grid()
    if grid is None:
        raise RuntimeError("sequence parallel groups are not initialized: call "
                           "UlyssesSPAttentionHF.register_with_transformers(...) or initialize_sequence_parallel(N)")
    return grid


def _world_if_none(group):
    return comm.get_world_group() if group is None else group


def get_sequence_parallel_group():
    """The sequence-parallel group of this rank."""
    return _world_if_none(get_grid().get_sequence_parallel_group())


def get_sequence_data_parallel_group():
    """Every rank of this rank's (data x sequence) grid: the group ZeRO reduces over."""
    return _world_if_none(get_grid().get_sequence_data_parallel_group())


def get_sequence_parallel_world_size() -> int:
    return get_grid().size("sequence")


def get_sequence_data_parallel_world_size() -> int:
    return get_grid().get_sequence_data_parallel_world_size()


def get_sequence_parallel_rank() -> int:
    return get_grid().axis_rank("sequence")


def get_sequence_data_parallel_rank() -> int:
    return get_grid().get_sequence_data_parallel_rank()


# one axis besides data: DeepSpeed aliases the model-parallel names to the sequence-parallel ones
get_model_parallel_rank = get_sequence_parallel_rank
get_model_parallel_world_size = get_sequence_parallel_world_size
get_model_parallel_group = get_sequence_parallel_group

register_grid_view(sys.modules[__name__], get_grid)
