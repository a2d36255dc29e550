"""The gradient norm over a whole data x pipe x tensor grid, and the optimizer step clipped by it.

A ZeRO strategy knows only its data-parallel group. On a grid with pipeline stages or tensor
shards every rank must clip by the same global norm (and skip an overflowing step together), else
replicas of one parameter drift apart. Each element of the model is counted exactly once:

* a data-replicated fragment (stage 0) by data rank 0 only; partitioned stages' fragments are
  disjoint over the data ranks already;
* a tensor-sharded parameter (``tensor_model_parallel=True``) by every tensor rank (its slice), a
  replicated one by tensor rank 0 only;
* a tied parameter by its owning pipeline stage only;

and the squares are summed over the whole world.
"""

from __future__ import annotations

import math

import torch

from shardwise import comm
from shardwise.precision import StepResult


def global_grad_norm_sq(strategy, module, grid, *, loss_scale: float, skip=frozenset(), device=None) -> float:
    """Squared L2 norm of the reduced, unscaled gradients over every rank of ``grid``."""
    sharded = {n for n, p in module.named_parameters() if getattr(p, "tensor_model_parallel", False)}
    tensor_rank = grid.get_tensor_model_parallel_rank() if hasattr(grid, "get_tensor_model_parallel_rank") else 0
    sq = torch.zeros((), dtype=torch.float32, device=device)
    if not (strategy.replicated and grid.get_data_parallel_rank() != 0):
        for batch in strategy.fragment_batches():
            for name, start, end, _ in batch:
                if name in skip or (tensor_rank != 0 and name not in sharded):
                    continue
                g = strategy.local_grad(name, start, end).float().reshape(-1)
                sq += torch.dot(g, g)
    if comm.get_world_size() > 1:
        comm.all_reduce(sq)
    return float(sq) / (loss_scale * loss_scale)


class GridNormStep:
    """A ZeRO strategy whose ``step`` takes the norm and overflow over the whole grid; the strategy
    then steps with the unscale and clip folded into one coefficient."""

    def __init__(self, inner, norm_sq) -> None:
        self._inner = inner
        self._norm_sq = norm_sq  # loss_scale -> global squared norm of the unscaled gradients

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def step(self, *, loss_scale: float, clip: float) -> StepResult:
        sq = self._norm_sq(loss_scale)
        norm = math.sqrt(sq) if math.isfinite(sq) else float("inf")
        if not math.isfinite(norm) and self._inner.precision.check_overflow:
            return StepResult(grad_norm=float("inf"), overflow=True)
        coef = 1.0
        if clip > 0 and clip / (norm + 1e-6) < 1.0:
            coef = clip / (norm + 1e-6)
        self._inner.step(loss_scale=loss_scale / coef, clip=0.0)
        return StepResult(grad_norm=norm, overflow=False)


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
