"""The sequence-parallel process groups: DeepSpeed's ``parallel_state_sp`` "mpu" module.

``initialize_sequence_parallel(N)`` lays the world out as a (data, sequence) grid with the sequence
axis varying fastest, so ranks ``[i*N, (i+1)*N)`` form sequence-parallel group ``i`` (DeepSpeed's
layout). The *sequence-data-parallel* group is every rank of the grid: ZeRO shards and reduces over
it. This module is what ``register_with_transformers`` returns and ``initialize(mpu=...)`` takes;
like DeepSpeed's it has no ``get_data_parallel_*`` functions (the engine derives the data-parallel
size as world / N).
"""

from __future__ import annotations

from shardwise import comm
from shardwise.topology import ParallelGrid, ProcessTopology

_GRID: ParallelGrid | None = None


def _release_sequence_parallel_groups() -> None:
    """Forget the groups (after the world group was destroyed)."""
    global _GRID
    _GRID = None


def initialize_sequence_parallel(sequence_parallel_size: int) -> None:
    """Create the sequence-parallel and sequence-data-parallel groups on every rank (collective)."""
    global _GRID
    if not comm.is_initialized():
        raise RuntimeError("initialize_sequence_parallel(): no process group yet; call "
                           "shardwise.init_distributed() first")
    world = comm.get_world_size()
    if not isinstance(sequence_parallel_size, int) or sequence_parallel_size <= 1:
        raise ValueError(f"sequence_parallel_size must be an integer greater than 1, got {sequence_parallel_size!r}")
    if world < sequence_parallel_size or world % sequence_parallel_size:
        raise ValueError(f"world size {world} is not a multiple of sequence_parallel_size {sequence_parallel_size}")
    if _GRID is not None:
        if _GRID.size("sequence") == sequence_parallel_size:
            return  # already set up with the same size (a second register_with_transformers call)
        raise RuntimeError(f"sequence parallel groups already exist with size {_GRID.size('sequence')}; "
                           f"cannot re-create them with size {sequence_parallel_size}")
    topo = ProcessTopology(("data", "sequence"), (world // sequence_parallel_size, sequence_parallel_size))
    _GRID = ParallelGrid(topo)


def is_initialized() -> bool:
    return _GRID is not None


def get_grid() -> ParallelGrid:
    if _GRID is None:
        raise RuntimeError("sequence parallel groups are not initialized: call "
                           "UlyssesSPAttentionHF.register_with_transformers(...) or initialize_sequence_parallel(N)")
    return _GRID


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
