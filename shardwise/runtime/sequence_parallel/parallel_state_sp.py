"""The sequence-parallel process groups: DeepSpeed's ``parallel_state_sp`` "mpu" module.

``initialize_sequence_parallel(N)`` builds and activates a (data, sequence) grid (``shardwise.topology``;
these functions are views of the active grid), the sequence axis varying fastest, so ranks ``[i*N, (i+1)*N)`` form sequence-parallel group ``i`` (DeepSpeed's
layout). With ``tensor_parallel_size`` T > 1 the grid is (data, sequence, tensor), tensor fastest: AutoTP
shards the model over the tensor axis and each tensor rank's heads are exchanged over the sequence axis. The *sequence-data-parallel* group is every rank of the grid: ZeRO shards and reduces over
it. This module is what ``register_with_transformers`` returns and ``initialize(mpu=...)`` takes;
like DeepSpeed's it has no ``get_data_parallel_*`` functions (the engine derives the data-parallel
size as world / N).
"""

from __future__ import annotations

from shardwise import comm
from shardwise.parallel_dims import ParallelDims
from shardwise.topology import ParallelGrid, active_grid


def initialize_sequence_parallel(sequence_parallel_size: int, *, tensor_parallel_size: int = 1) -> None:
    """Build the (data x sequence [x tensor]) grid on every rank (collective) and activate it: these
    functions are views of the active grid."""
    if not comm.is_initialized():
        raise RuntimeError("initialize_sequence_parallel(): no process group yet; call "
                           "shardwise.init_distributed() first")
    world = comm.get_world_size()
    if not isinstance(sequence_parallel_size, int) or sequence_parallel_size <= 1:
        raise ValueError(f"sequence_parallel_size must be an integer greater than 1, got {sequence_parallel_size!r}")
    tp = tensor_parallel_size
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tensor_parallel_size must be a positive integer, got {tp!r}")
    if world % (sequence_parallel_size * tp):
        raise ValueError(f"world size {world} is not a multiple of sequence_parallel_size {sequence_parallel_size}"
                         + (f" x tensor_parallel_size {tp}" if tp > 1 else ""))
    grid = _sequence_grid()
    if grid is not None:
        if grid.size("sequence") == sequence_parallel_size and grid.size("model") == tp:
            return  # already set up with the same sizes (a second register_with_transformers call)
        raise RuntimeError(f"sequence parallel groups already exist with sequence size {grid.size('sequence')} and "
                           f"tensor size {grid.size('model')}; cannot re-create them with sequence size "
                           f"{sequence_parallel_size} and tensor size {tp}")
    dims = ParallelDims(data=world // (sequence_parallel_size * tp), sequence=sequence_parallel_size,
                        tensor=tp).validate(world)
    ParallelGrid.from_dims(dims).activate()


def _sequence_grid():
    grid = active_grid()
    return grid if grid is not None and grid.size("sequence") > 1 else None


def is_initialized() -> bool:
    return _sequence_grid() is not None


def get_grid() -> ParallelGrid:
    grid = _sequence_grid()
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
