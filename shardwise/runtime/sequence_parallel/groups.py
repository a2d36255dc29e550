"""The sequence-parallel groups ``register_with_transformers`` lays out before there is an engine.

Ulysses attention needs its sequence group when it is installed into Transformers, before ``initialize``:
``sequence_parallel_grid(N)`` builds the (data, sequence) grid (``shardwise.topology``), the sequence axis
varying fastest, so ranks ``[i*N, (i+1)*N)`` form sequence-parallel group ``i``; with ``tensor_parallel_size``
T > 1 it is (data, sequence, tensor), tensor fastest: AutoTP shards the model over the tensor axis and each
tensor rank's heads are exchanged over the sequence axis. The grid is activated, so code that asks the
active grid finds it; ``initialize`` takes its sizes (``registered_grid``) and builds the engine's grid once
every size, the expert size included, is known (the groups already made are found again, not re-created).
"""

from __future__ import annotations

from shardwise import comm
from shardwise.parallel_dims import ParallelDims
from shardwise.topology import ParallelGrid, active_grid


def sequence_parallel_grid(sequence_parallel_size: int, *, tensor_parallel_size: int = 1) -> ParallelGrid:
    """Build the (data x sequence [x tensor]) grid on every rank (collective), activate it and return it. A
    second call with the same sizes returns the grid already there."""
    if not comm.is_initialized():
        raise RuntimeError("sequence parallelism: no process group yet; call shardwise.init_distributed() first")
    world = comm.get_world_size()
    if not isinstance(sequence_parallel_size, int) or sequence_parallel_size <= 1:
        raise ValueError(f"sequence_parallel_size must be an integer greater than 1, got {sequence_parallel_size!r}")
    tp = tensor_parallel_size
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tensor_parallel_size must be a positive integer, got {tp!r}")
    if world % (sequence_parallel_size * tp):
        raise ValueError(f"world size {world} is not a multiple of sequence_parallel_size {sequence_parallel_size}"
                         + (f" x tensor_parallel_size {tp}" if tp > 1 else ""))
    grid = registered_grid()
    if grid is not None:
        if grid.size("sequence") == sequence_parallel_size and grid.size("model") == tp:
            return grid  # already set up with the same sizes (a second register_with_transformers call)
        raise RuntimeError(f"sequence parallel groups already exist with sequence size {grid.size('sequence')} and "
                           f"tensor size {grid.size('model')}; cannot re-create them with sequence size "
                           f"{sequence_parallel_size} and tensor size {tp}")
    dims = ParallelDims(data=world // (sequence_parallel_size * tp), sequence=sequence_parallel_size,
                        tensor=tp).validate(world)
    grid = ParallelGrid.from_dims(dims)
    grid.activate()
    return grid


def registered_grid() -> ParallelGrid | None:
    """The active grid when it has a sequence axis (the one ``sequence_parallel_grid`` laid out, or the engine's
    that replaced it), else None."""
    grid = active_grid()
    return grid if grid is not None and grid.size("sequence") > 1 else None
