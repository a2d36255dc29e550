"""Distributed sampling that never materialises the list of sample indices.

``torch.utils.data.DistributedSampler`` builds the whole shuffled index list in every process
each epoch (a Python list of N ints, ~36 MB per million samples, per rank). Here the shuffle is
a keyed permutation computed one index at a time (a small Feistel network with cycle walking),
so a rank's memory for sampling is constant whatever the data set size.

Sharding follows DistributedSampler: position ``p`` of the (shuffled) order goes to rank
``p % num_replicas``. With ``drop_last`` the tail that does not divide evenly is dropped;
without it the order is padded by wrapping to the start, so every rank gets the same number of
samples (the collectives of the training step need equal counts).
"""
from __future__ import annotations

from typing import Iterator

from torch.utils.data import Sampler

__all__ = ["LazyPermutation", "ShardSampler"]

_M64 = (1 << 64) - 1
_ROUNDS = 6


def _mix(z: int) -> int:
    """splitmix64's finaliser: a cheap, well-spread 64-bit hash."""
    z = (z + 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


class LazyPermutation:
    """A pseudo-random permutation of ``range(n)`` given by ``seed``; ``perm(i)`` in O(1) memory."""

    def __init__(self, n: int, seed: int) -> None:
        self.n = n
        bits = max(2, (max(n, 1) - 1).bit_length())
        bits += bits % 2
        self._half = bits // 2
        self._mask = (1 << self._half) - 1
        self._keys = [_mix((seed & _M64) * _ROUNDS + r) for r in range(_ROUNDS)]

    def _encrypt(self, x: int) -> int:
        left, right = x >> self._half, x & self._mask
        for key in self._keys:
            left, right = right, left ^ (_mix(right ^ key) & self._mask)
        return (left << self._half) | right

    def __call__(self, i: int) -> int:
        if not 0 <= i < self.n:
            raise IndexError(f"{i} is outside range({self.n})")
        x = self._encrypt(i)
        while x >= self.n:  # cycle walking: the domain is a power of 4 >= n, so this ends quickly
            x = self._encrypt(x)
        return x


class ShardSampler(Sampler[int]):
    """This rank's disjoint share of ``range(num_samples)``, reshuffled by ``set_epoch``.

    ``set_start(k)`` skips the first ``k`` samples of the share for the current epoch (resuming
    in the middle of an epoch); ``set_epoch`` starts the share over.
    """

    def __init__(self, num_samples: int, *, num_replicas: int, rank: int, shuffle: bool = True,
                 seed: int = 0, drop_last: bool = False) -> None:
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} is not in [0, {num_replicas})")
        self.num_samples = num_samples
        self.num_replicas = num_replicas
        self.rank = rank
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        if drop_last:
            self.per_rank = num_samples // num_replicas
        else:
            self.per_rank = -(-num_samples // num_replicas) if num_samples else 0
        self.epoch = 0
        self.start = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.start = 0

    def set_start(self, start: int) -> None:
        if not 0 <= start <= self.per_rank:
            raise ValueError(f"start {start} is outside this rank's share of {self.per_rank} samples")
        self.start = start

    def __len__(self) -> int:
        return self.per_rank - self.start

    def __iter__(self) -> Iterator[int]:
        order = LazyPermutation(self.num_samples, self.seed * 1_000_003 + self.epoch) if self.shuffle else None
        for j in range(self.start, self.per_rank):
            pos = (self.rank + j * self.num_replicas) % self.num_samples
            yield order(pos) if order is not None else pos
