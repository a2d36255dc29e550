"""Tensor parallelism's sequence parallelism (Megatron): gradients of parameters applied to a sequence shard."""

from __future__ import annotations

import torch

from shardwise import comm


def sync_sequence_parallel_grads(module: torch.nn.Module, group) -> int:
    """All-reduce, over the tensor group, the gradients of parameters marked ``sequence_parallel=True``
    (norms and biases applied to a sequence shard: each tensor rank holds a partial sum) as autograd
    produces them, before any accumulation or data-parallel reduction. Returns how many."""
    count = 0
    for p in module.parameters():
        if p.requires_grad and getattr(p, "sequence_parallel", False):
            p.register_hook(lambda g: _all_reduced(g, group))
            count += 1
    return count


def _all_reduced(g: torch.Tensor, group) -> torch.Tensor:
    g = g.clone()
    comm.all_reduce(g, group=group)
    return g
