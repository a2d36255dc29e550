"""The one training step: counters, loss accounting, the accumulation boundary, loss scaling and
the boundary update. The ordinary engine drives it from the user's ``backward``/``step`` calls; the
pipeline executor drives the same object from its schedule (``shardwise/pipe/engine.py``). Neither
keeps a copy of this arithmetic.

Per micro-batch: ``begin_backward()`` -> autograd on ``scale(loss)`` (or on a stage's received
gradients) -> ``end_backward()`` -> ``record_loss(loss)``; then ``micro_step()`` (the engine: one per
micro-batch) or ``batch_step(n)`` (the pipeline: once per batch of ``n`` micro-batches). At the
boundary both run ``_update``: the clipped optimizer step of the ZeRO strategy (``clipped_step``
below), the loss-scale and scheduler updates, zeroed gradients, counters.

The norm and the clip: the gradient norm summed once over the right ranks, the overflow
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
from shardwise.training_state import StepCounters


@dataclass
class StepOutcome:
    """What one boundary update did (for the engine's logging and monitors)."""

    loss: float | None  # mean loss of the step's micro-batches (this rank; the batch mean for a pipeline)
    grad_norm: float | None
    overflow: bool
    loss_scale: float  # the scale the step's gradients carried


class TrainingStep:
    """Bookkeeping of training steps; the strategy does the math, this object sequences it."""

    def __init__(self, *, strategy, loss_scaler, batch, grid, module,
                 clip: float = 0.0, check_overflow: bool = False, norm_skip=frozenset(), lr_scheduler=None,
                 device=None, after_update=()) -> None:
        """``after_update``: callables run after each optimizer step that was taken (before the scheduler's
        step), on every rank (AutoEP's loss-free balancing moves its router biases there: collective)."""
        self.strategy = strategy
        self.loss_scaler = loss_scaler  # None without fp16 dynamic/static loss scaling
        self.lr_scheduler = lr_scheduler
        self.batch = batch  # BatchSizes (the engine's set_train_batch_size replaces it)
        self._grid, self._module, self._norm_skip = grid, module, frozenset(norm_skip)
        self._scopes: dict[bool, NormScope] = {}  # norm_scope by strategy.norm_is_local (1-bit Adam flips it)
        self._after_update = list(after_update)
        self._clip, self._check_overflow, self._device = float(clip), bool(check_overflow), device
        self.global_steps = 0
        self.global_samples = 0
        self.micro_steps = 0
        self.skipped_steps = 0
        self.boundary_override: bool | None = None
        self.no_sync_depth = 0
        self.backwards_since_step = 0
        self._loss_sum = torch.zeros((), dtype=torch.float32, device=device)
        self._loss_count = 0
        self.before_update: Callable[[], bool] | None = None  # fault tolerance (shardwise/ft): False discards the step

    # -- the accumulation boundary ------------------------------------------------------------------
    def is_boundary(self) -> bool:
        if self.boundary_override is not None:
            return self.boundary_override
        return (self.micro_steps + 1) % self.batch.gradient_accumulation_steps == 0

    # -- backward ---------------------------------------------------------------------------------
    def scale(self, loss: torch.Tensor, *, divide_by_gas: bool = True) -> torch.Tensor:
        """The tensor autograd starts from: the loss over the accumulation steps, times the loss scale."""
        scaled = loss.float()
        gas = self.batch.gradient_accumulation_steps
        if divide_by_gas and gas > 1:
            scaled = scaled / gas
        if self.loss_scaler is not None:
            scaled = self.loss_scaler.scale_loss(scaled)
        return scaled

    def begin_backward(self) -> None:
        """Arm the strategy's gradient hooks for the coming autograd pass."""
        self.strategy.prepare_backward(boundary=self.is_boundary(), no_sync=self.no_sync_depth > 0)

    def end_backward(self) -> None:
        """Wait for the reductions still in flight; count one backward."""
        self.strategy.finish_backward()
        self.backwards_since_step += 1

    def record_loss(self, loss: torch.Tensor) -> None:
        self._loss_sum += loss.detach().float().reshape(())
        self._loss_count += 1

    # -- steps ------------------------------------------------------------------------------------
    def micro_step(self, lr_kwargs=None) -> StepOutcome | None:
        """One micro-batch done (the engine's ``step()``); the update when it was the boundary."""
        outcome = None
        if self.is_boundary():
            if self.backwards_since_step == 0:
                raise RuntimeError(
                    "engine.step() at an accumulation boundary without engine.backward(loss) since the last "
                    "step: call engine.backward(loss), not loss.backward(), so gradients are reduced across ranks"
                )
            if self.no_sync_depth:
                raise RuntimeError("engine.step() at an accumulation boundary inside engine.no_sync()")
            outcome = self._update(lr_kwargs or {})
        self.micro_steps += 1
        return outcome

    def batch_step(self, micro_batches: int, *, batch_loss: torch.Tensor) -> StepOutcome:
        """A whole batch of ``micro_batches`` done at once (the pipeline); ``batch_loss`` is what the step
        reports (the mean over micro-batches and replicas)."""
        self._loss_sum.copy_(batch_loss.detach().float().reshape(()))
        self._loss_count = 1
        self.micro_steps += micro_batches - 1
        outcome = self._update({})
        self.micro_steps += 1
        return outcome

    def _update(self, lr_kwargs: dict) -> StepOutcome | None:
        if self.before_update is not None and not self.before_update():
            return self._discard()
        scale = self.loss_scaler.loss_scale if self.loss_scaler is not None else 1.0
        scope = self._scopes.get(self.strategy.norm_is_local)
        if scope is None:  # (the grid, the parameters and the strategy's groups are fixed: found once)
            scope = self._scopes[self.strategy.norm_is_local] = norm_scope(
                self.strategy, grid=self._grid, module=self._module, skip=self._norm_skip)
        result = clipped_step(self.strategy, scope, loss_scale=scale, clip=self._clip,
                              check_overflow=self._check_overflow, device=self._device)
        if self.loss_scaler is not None:
            self.loss_scaler.update_scale(result.overflow)
        if result.overflow:
            self.skipped_steps += 1
        else:
            for hook in self._after_update:
                hook()
            if self.lr_scheduler is not None:
                self.lr_scheduler.step(**lr_kwargs)
        self.strategy.zero_grad()
        self.global_steps += 1
        self.global_samples += self.batch.train_batch_size
        self.backwards_since_step = 0
        loss = float(self._loss_sum) / self._loss_count if self._loss_count else None
        self._loss_sum.zero_()
        self._loss_count = 0
        return StepOutcome(loss=loss, grad_norm=result.grad_norm, overflow=result.overflow, loss_scale=scale)

    def _discard(self) -> None:
        """The step in flight is dropped (fault tolerance: a replica group was lost during it): no update,
        the counters stay, the gradients and the loss of its micro-batches are cleared."""
        self.strategy.zero_grad()
        self.backwards_since_step = 0
        self._loss_sum.zero_()
        self._loss_count = 0
        return None

    # -- counters for checkpoints and monitors ----------------------------------------------------
    def counters(self) -> StepCounters:
        return StepCounters(global_steps=self.global_steps, global_samples=self.global_samples,
                            micro_steps=self.micro_steps, skipped_steps=self.skipped_steps)

    def restore(self, counters: StepCounters) -> None:
        self.global_steps, self.global_samples = counters.global_steps, counters.global_samples
        self.micro_steps, self.skipped_steps = counters.micro_steps, counters.skipped_steps
        # Checkpoints hold no partly accumulated gradients: the next micro-batch starts a window. (A
        # checkpoint saved with another gradient_accumulation_steps, e.g. DeepSpeed's at another world
        # size, would otherwise put the boundary in the middle of it.)
        self.micro_steps -= self.micro_steps % self.batch.gradient_accumulation_steps


# -- the norm over the right ranks, and the clipped step ----------------------------------------
@dataclass(frozen=True)
class NormScope:
    """Over which ranks the local squared norms are summed, and which parameters count."""

    group: object = None  # the process group summed over (None: the world)
    reduce: bool = True  # False: this rank's sum is already the whole norm
    # parameter names that count (None: all): a set's membership test, so the strategy asking it per
    # fragment calls nothing back in this file
    counted: Callable[[str], bool] | None = None
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
    named = list(module.named_parameters())
    sharded = {n for n, p in named if getattr(p, "tensor_model_parallel", False)}
    if not strategy.norm_is_local:  # MoE experts: partitioned over expert-data groups that span the tensor ranks
        sharded |= strategy.layout.expert_names
    skip = frozenset(skip)
    # every name a strategy's fragments carry: the module's, and the layout's (experts: by global index)
    names = {n for n, _ in named} | {n for n, _ in strategy.layout.named(named)}
    counted = frozenset(n for n in names if n not in skip and (tensor_rank == 0 or n in sharded)).__contains__
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
