"""The accumulation-boundary step: the gradient norm summed once over the right ranks, the overflow
check and the clip coefficient (``shardwise.precision``), then the strategy's step.

A ZeRO strategy reports the squared norm of the gradients it holds (``local_grad_norm_sq``) and
steps with a given coefficient (``apply_step``); it knows only its data-parallel group. Which ranks
hold the other pieces of the norm is decided here, once, from the grid (``norm_scope``):

* data parallelism only: a partitioned strategy's shares are disjoint over the data group, so they
  are summed over it; a replicated one (stage 0) already holds every element: nothing to sum;
* with pipeline stages or tensor shards every rank must clip by the same norm and skip an
  overflowing step together, else replicas of one parameter drift apart. Each element is counted
  once: a tensor-sharded parameter (``tensor_model_parallel=True``) by every tensor rank (its
  slice), a replicated one by tensor rank 0 only, a tied parameter by its owning stage only; the sums
  go over the model-parallel (pipe x tensor) group for a replicated strategy (every data rank then
  holds the same total), over the whole world for a partitioned one.

Exactly one all-reduce of the norm per step (none for data-parallel stage 0).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from shardwise import comm
from shardwise.precision import StepResult, unscale_and_clip


@dataclass(frozen=True)
class NormScope:
    """Over which ranks the local squared norms are summed, and which parameters count."""

    group: object = None  # the process group summed over (None: the world)
    reduce: bool = True  # False: this rank's sum is already the whole norm
    counted: Callable[[str], bool] | None = None  # parameter names that count (None: all)
    contributes: bool = True  # False: this rank's sum is a copy of another rank's, counted there


def norm_scope(strategy, *, grid, module: torch.nn.Module, skip=frozenset()) -> NormScope:
    """The ``NormScope`` of ``strategy`` on ``grid``; ``skip``: names of parameters another rank counts
    (tied duplicates on a pipeline stage that does not own them)."""
    pipe = grid.get_pipe_parallel_world_size()
    tensor_size = getattr(grid, "get_tensor_model_parallel_world_size", lambda: 1)()
    if pipe * tensor_size == 1:
        if strategy.norm_is_local:
            return NormScope(reduce=False)
        return NormScope(group=strategy.dp_group)
    tensor_rank = grid.get_tensor_model_parallel_rank() if tensor_size > 1 else 0
    sharded = {n for n, p in module.named_parameters() if getattr(p, "tensor_model_parallel", False)}
    skip = frozenset(skip)

    def counted(name: str) -> bool:
        return name not in skip and (tensor_rank == 0 or name in sharded)

    if not strategy.norm_is_local:
        return NormScope(group=None, counted=counted)
    model_group = grid.get_model_parallel_group()
    if model_group is None and grid.get_data_parallel_world_size() > 1:  # a user's mpu without that group
        return NormScope(group=None, counted=counted, contributes=grid.get_data_parallel_rank() == 0)
    return NormScope(group=model_group, counted=counted)


def clipped_step(strategy, scope: NormScope, *, loss_scale: float, clip: float, check_overflow: bool,
                 device=None) -> StepResult:
    """The global norm of the unscaled gradients, then (unless it overflows) the strategy's step with
    the unscale x clip coefficient. Collective over ``scope.group`` when ``scope.reduce``."""
    sq = strategy.local_grad_norm_sq(counted=scope.counted)
    if device is not None:
        sq = sq.to(device)
    if not scope.contributes:
        sq = torch.zeros_like(sq)
    if scope.reduce and comm.get_world_size(scope.group) > 1:
        comm.all_reduce(sq, group=scope.group)
    norm, coef = unscale_and_clip(sq, loss_scale=loss_scale, clip=clip, check_overflow=check_overflow)
    if check_overflow and strategy.overflow_anywhere(coef is None):
        return StepResult(grad_norm=float("inf"), overflow=True)
    strategy.apply_step(coef=coef, coef_fixed=loss_scale == 1.0 and clip <= 0 and not check_overflow)
    return StepResult(grad_norm=norm, overflow=False)
