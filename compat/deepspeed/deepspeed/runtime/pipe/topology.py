"""``deepspeed.runtime.pipe.topology``: see ``shardwise.topology``."""

from shardwise.topology import *  # noqa: F401,F403
from shardwise.topology import PipeDataParallelTopology, PipeModelDataParallelTopology, ProcessTopology  # noqa: F401


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
