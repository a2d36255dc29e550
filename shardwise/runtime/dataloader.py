"""Data loading helpers: distributed sampling and ``RepeatingLoader``."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, DistributedSampler


class RepeatingLoader:
    """Wrap an iterable loader so iteration never ends (restarts it, bumping the sampler epoch)."""

    def __init__(self, loader) -> None:
        self.loader = loader
        self.epoch = 0
        self._it = iter(loader)

    def __iter__(self):
        return self

    def __next__(self):
        try:
            return next(self._it)
        except StopIteration:
            self.epoch += 1
            sampler = getattr(self.loader, "sampler", None)
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
    """A DataLoader whose sampler gives this data-parallel rank its own disjoint share."""
    if isinstance(dataset, torch.utils.data.IterableDataset):
        return DataLoader(dataset, batch_size=batch_size, collate_fn=collate_fn, drop_last=drop_last)
    sampler = DistributedSampler(
        dataset, num_replicas=dp_world_size, rank=dp_rank, shuffle=shuffle, seed=seed, drop_last=drop_last
    )
    return DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        collate_fn=collate_fn,
        drop_last=drop_last,
        num_workers=num_workers,
        pin_memory=pin_memory,
    )
