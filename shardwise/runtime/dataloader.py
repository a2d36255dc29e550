"""Data loading helpers: distributed sampling that resumes mid-epoch, and ``RepeatingLoader``.

The loader ``engine.training_dataloader`` (and ``engine.deepspeed_io``) returns counts the batches
it hands out; its ``state_dict()`` is ``{"epoch", "consumed"}``: the epoch and how many positions
of that epoch's global order (the shuffled dataset indices every rank agrees on) have been handed
to the data-parallel group.  A checkpoint stores it; after ``load_checkpoint`` the loader goes on
at the next unseen position, even at another data-parallel size (the rest of the order is split
among the new ranks).
"""

from __future__ import annotations

import math

import torch
from torch.utils.data import DataLoader, DistributedSampler


class ResumableDistributedSampler(DistributedSampler):
    """``DistributedSampler`` (same order, same padding, same split) that can start part way.

    ``start`` positions of the epoch's global order are skipped; the rest is padded (or cut,
    with ``drop_last``) to a multiple of the replicas and dealt out round-robin.  With
    ``start == 0`` the indices are exactly those of ``torch.utils.data.DistributedSampler``.
    """

    def __init__(self, dataset, **kwargs) -> None:
        super().__init__(dataset, **kwargs)
        self.start = 0  # positions of this epoch's order to skip in the next pass
        self.consumed = 0  # positions handed out so far this epoch (kept by the loader)

    def _order(self) -> list[int]:
        n = len(self.dataset)
        if not self.shuffle:
            return list(range(n))
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)
        return torch.randperm(n, generator=g).tolist()

    def _total(self, remaining: int) -> int:
        if self.drop_last:
            return remaining // self.num_replicas * self.num_replicas
        return math.ceil(remaining / self.num_replicas) * self.num_replicas

    def __iter__(self):
        rest = self._order()[self.start :]
        total = self._total(len(rest))
        if rest and total > len(rest):  # pad with the start of the rest, as DistributedSampler does
            rest = (rest * math.ceil(total / len(rest)))[:total]
        return iter(rest[self.rank : total : self.num_replicas])

    def __len__(self) -> int:
        return self._total(len(self.dataset) - self.start) // self.num_replicas

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.start = self.consumed = 0
        self.epoch = epoch

    def state_dict(self) -> dict:
        return {"epoch": int(self.epoch), "consumed": int(self.consumed)}

    def load_state_dict(self, state: dict) -> None:
        self.epoch = int(state["epoch"])
        self.start = self.consumed = min(int(state["consumed"]), len(self.dataset))


class ResumableDataLoader(DataLoader):
    """A ``DataLoader`` over a :class:`ResumableDistributedSampler` that records how far it got.

    Each pass seeds the loader's own generator from (seed, epoch, start) for the workers' base
    seed, instead of drawing it from the global torch RNG as a plain DataLoader does: a resumed
    run creates its iterator at another moment, and must not shift the model's random stream."""

    def __init__(self, dataset, **kwargs) -> None:
        kwargs.setdefault("generator", torch.Generator())
        super().__init__(dataset, **kwargs)

    def __iter__(self):
        sampler = self.sampler
        start = sampler.start
        self.generator.manual_seed(((sampler.seed * 1_000_003 + sampler.epoch) * 1_000_003 + start) % 2**63)
        per_batch = self.batch_size * sampler.num_replicas
        n = len(self.dataset)
        sampler.consumed = start
        for i, batch in enumerate(super().__iter__(), 1):
            sampler.consumed = min(start + i * per_batch, n)
            yield batch
        sampler.start = 0  # a completed pass: the next one (same epoch unless set_epoch) starts afresh

    def state_dict(self) -> dict:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state)


class RepeatingLoader:
    """Wrap an iterable loader so iteration never ends (restarts it, bumping the sampler epoch).

    The underlying iterator is created at the first ``next``, so wrapping a loader before
    ``engine.load_checkpoint`` still resumes at the restored position."""

    def __init__(self, loader) -> None:
        self.loader = loader
        self.epoch = 0
        self._it = None

    def __iter__(self):
        return self

    def __next__(self):
        if self._it is None:
            self._it = iter(self.loader)
        try:
            return next(self._it)
        except StopIteration:
            sampler = getattr(self.loader, "sampler", None)
            self.epoch = getattr(sampler, "epoch", self.epoch) + 1
            if hasattr(sampler, "set_epoch"):
                sampler.set_epoch(self.epoch)
            self._it = iter(self.loader)
            return next(self._it)


def build_dataloader(
    dataset,
    *,
    batch_size: int,
    dp_world_size: int,
    dp_rank: int,
    collate_fn=None,
    drop_last: bool = False,
    shuffle: bool = True,
    seed: int = 0,
    num_workers: int = 0,
    pin_memory: bool = False,
) -> DataLoader:
    """A DataLoader whose sampler gives this data-parallel rank its own disjoint share, resumably."""
    if isinstance(dataset, torch.utils.data.IterableDataset):
        return DataLoader(dataset, batch_size=batch_size, collate_fn=collate_fn, drop_last=drop_last)
    sampler = ResumableDistributedSampler(
        dataset, num_replicas=dp_world_size, rank=dp_rank, shuffle=shuffle, seed=seed, drop_last=drop_last
    )
    return ResumableDataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        collate_fn=collate_fn,
        drop_last=drop_last,
        num_workers=num_workers,
        pin_memory=pin_memory,
    )
