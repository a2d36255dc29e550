"""``deepspeed.runtime.pipe.topology``: DeepSpeed's names for the rank layout (``shardwise.rank_layout``) and the
grid (``shardwise.topology``)."""

from shardwise import comm
from shardwise.topology import *  # noqa: F401,F403
from shardwise.topology import PipeDataParallelTopology, PipeModelDataParallelTopology, ProcessTopology  # noqa: F401
from shardwise.topology import ParallelGrid


def PipelineParallelGrid(topology: ProcessTopology | None = None, process_group=None) -> ParallelGrid:  # noqa: N802
    """DeepSpeed's grid class name: the grid of ``topology`` (default: data parallelism over every rank)."""
    if process_group is not None:
        raise ValueError("PipelineParallelGrid(process_group=...) is not supported (DeepSpeed ignores it too)")
    return ParallelGrid.for_topology(topology or ProcessTopology.for_world(comm.get_world_size()))


def _prime_factors(n: int) -> list[int]:
    """The prime factors of ``n`` in ascending order, with repeats (DeepSpeed's helper); ValueError below 1."""
    if n < 1:
        raise ValueError(f"_prime_factors: expected a positive integer, got {n}")
    factors, p = [], 2
    while p * p <= n:
        while n % p == 0:
            factors.append(p)
            n //= p
        p += 1
    if n > 1:
        factors.append(n)
    return factors
