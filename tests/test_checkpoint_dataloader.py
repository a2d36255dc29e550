"""The resumable distributed sampler: the order of torch's DistributedSampler, and a restored
position continues with exactly the unseen samples, at the same or another number of ranks."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DistributedSampler

from shardwise.runtime.dataloader import (
    RepeatingLoader,
    ResumableDataLoader,
    ResumableDistributedSampler,
    build_dataloader,
)


@pytest.mark.parametrize("n,world,drop_last,shuffle", [(37, 4, False, True), (37, 4, True, True), (10, 3, False, False),
                                                       (8, 2, True, False), (3, 4, False, True)])
def test_fresh_order_is_torchs(n, world, drop_last, shuffle):
    data = list(range(n))
    for epoch in (0, 3):
        for rank in range(world):
            ours = ResumableDistributedSampler(data, num_replicas=world, rank=rank, shuffle=shuffle, seed=5,
                                               drop_last=drop_last)
            ref = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=shuffle, seed=5, drop_last=drop_last)
            ours.set_epoch(epoch)
            ref.set_epoch(epoch)
            assert list(ours) == list(ref) and len(ours) == len(ref)


def _loaders(n, world, batch):
    return [build_dataloader(list(range(n)), batch_size=batch, dp_world_size=world, dp_rank=r, seed=1)
            for r in range(world)]


@pytest.mark.parametrize("new_world", [1, 2, 3])
def test_resume_continues_with_the_unseen_samples(new_world):
    n, batch = 41, 3
    loaders = _loaders(n, 2, batch)
    assert all(isinstance(ld, ResumableDataLoader) for ld in loaders)
    its = [iter(ld) for ld in loaders]
    seen = [i for _ in range(4) for it in its for i in next(it).tolist()]  # 4 batches on each of 2 ranks
    state = loaders[0].state_dict()
    assert state == loaders[1].state_dict() == {"epoch": 0, "consumed": 4 * batch * 2}

    resumed = _loaders(n, new_world, batch)
    for ld in resumed:
        ld.load_state_dict(state)
        ld.sampler.set_epoch(0)  # the usual per-epoch call does not reset a restored position
    rest = [i for ld in resumed for b in ld for i in b.tolist()]
    assert not set(seen) & set(rest), "a sample seen before the save came again"
    assert set(seen) | set(rest) == set(range(n)), "a sample was skipped"
    assert len(rest) == -(-(n - len(seen)) // new_world) * new_world  # padded only to split evenly
    full_order = loaders[0].sampler._order()
    assert set(seen) == set(full_order[: len(seen)])  # exactly the first positions of the epoch's order
    assert all(ld.state_dict()["consumed"] == n for ld in resumed)
    # The next pass of the same epoch is whole again; a new epoch starts from the beginning.
    assert sum(len(b) for b in resumed[0]) == len(resumed[0].sampler)
    resumed[0].sampler.set_epoch(1)
    assert resumed[0].state_dict() == {"epoch": 1, "consumed": 0}


def test_repeating_loader_bumps_the_epoch_and_starts_lazily():
    ld = build_dataloader(list(range(6)), batch_size=2, dp_world_size=2, dp_rank=0, seed=0)
    ld.load_state_dict({"epoch": 4, "consumed": 4})
    rep = RepeatingLoader(ld)  # wrapped after the restore; also fine before it (lazy)
    first = next(rep)
    assert first.numel() == 1 and ld.sampler.epoch == 4  # the one sample left for rank 0 in epoch 4
    nxt = next(rep)
    assert ld.sampler.epoch == 5 and ld.state_dict() == {"epoch": 5, "consumed": 4}
    g = torch.Generator().manual_seed(5)
    assert nxt.tolist() == torch.randperm(6, generator=g).tolist()[0:4:2]
