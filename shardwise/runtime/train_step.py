"""The one training step: counters, loss accounting, the accumulation boundary, loss scaling and
the boundary update. The ordinary engine drives it from the user's ``backward``/``step`` calls; the
pipeline executor drives the same object from its schedule (``shardwise/pipe/engine.py``). Neither
keeps a copy of this arithmetic.

Per micro-batch: ``begin_backward()`` -> autograd on ``scale(loss)`` (or on a stage's received
gradients) -> ``end_backward()`` -> ``record_loss(loss)``; then ``micro_step()`` (the engine: one per
micro-batch) or ``batch_step(n)`` (the pipeline: once per batch of ``n`` micro-batches). At the
boundary both run ``_update``: the clipped optimizer step of the ZeRO strategy (the norm reduced
once over the grid's norm group), the loss-scale and scheduler updates, zeroed gradients, counters.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

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

    def __init__(self, *, strategy, loss_scaler, gradient_accumulation_steps, train_batch_size, clip_step,
                 lr_scheduler=None, device=None) -> None:
        self.strategy = strategy
        self.loss_scaler = loss_scaler  # None without fp16 dynamic/static loss scaling
        self.lr_scheduler = lr_scheduler
        self._gas = gradient_accumulation_steps  # callables: set_train_batch_size changes them
        self._batch_size = train_batch_size
        self._clip_step = clip_step  # (loss_scale) -> StepResult: norm over the grid, clip, optimizer step
        self.global_steps = 0
        self.global_samples = 0
        self.micro_steps = 0
        self.skipped_steps = 0
        self.boundary_override: bool | None = None
        self.no_sync_depth = 0
        self.backwards_since_step = 0
        self._loss_sum = torch.zeros((), dtype=torch.float32, device=device)
        self._loss_count = 0

    # -- the accumulation boundary ------------------------------------------------------------------
    def is_boundary(self) -> bool:
        if self.boundary_override is not None:
            return self.boundary_override
        return (self.micro_steps + 1) % self._gas() == 0

    # -- backward ---------------------------------------------------------------------------------
    def scale(self, loss: torch.Tensor, *, divide_by_gas: bool = True) -> torch.Tensor:
        """The tensor autograd starts from: the loss over the accumulation steps, times the loss scale."""
        scaled = loss.float()
        gas = self._gas()
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

    def _update(self, lr_kwargs: dict) -> StepOutcome:
        scale = self.loss_scaler.loss_scale if self.loss_scaler is not None else 1.0
        result = self._clip_step(scale)
        if self.loss_scaler is not None:
            self.loss_scaler.update_scale(result.overflow)
        if result.overflow:
            self.skipped_steps += 1
        elif self.lr_scheduler is not None:
            self.lr_scheduler.step(**lr_kwargs)
        self.strategy.zero_grad()
        self.global_steps += 1
        self.global_samples += self._batch_size()
        self.backwards_since_step = 0
        loss = float(self._loss_sum) / self._loss_count if self._loss_count else None
        self._loss_sum.zero_()
        self._loss_count = 0
        return StepOutcome(loss=loss, grad_norm=result.grad_norm, overflow=result.overflow, loss_scale=scale)

    # -- counters for checkpoints and monitors ----------------------------------------------------
    def counters(self) -> StepCounters:
        return StepCounters(global_steps=self.global_steps, global_samples=self.global_samples,
                            micro_steps=self.micro_steps, skipped_steps=self.skipped_steps)

    def restore(self, counters: StepCounters) -> None:
        self.global_steps, self.global_samples = counters.global_steps, counters.global_samples
        self.micro_steps, self.skipped_steps = counters.micro_steps, counters.skipped_steps
