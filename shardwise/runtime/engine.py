"""The training engine: what ``shardwise.initialize`` returns for an ordinary model.

``Engine`` drives the shared ``TrainingStep`` (``runtime/train_step.py``: counters, loss scaling, the
accumulation boundary, the clipped update) from the user's ``forward``/``backward``/``step`` calls. Its
parts are built by ``runtime/parallelize.py`` in one fixed order; what it shares with the pipeline
engine (accessors, counters, checkpoints) is ``runtime/engine_base.py``.
"""

from __future__ import annotations

import abc

import torch

from shardwise.precision import cast_inputs
from shardwise.runtime import autocast as torch_autocast
from shardwise.runtime.engine_base import EngineBase


class Engine(EngineBase, metaclass=abc.ABCMeta):
    """What ``shardwise.initialize`` returns; DeepSpeed's ``DeepSpeedEngine`` API. The constructor is
    ``EngineBase``'s: ``config``, the ``grid`` (sizes and groups), the model and the client objects.
    (``abc.ABCMeta``: ``PipelineEngine`` registers as a virtual subclass, since DeepSpeed's is a
    ``DeepSpeedEngine`` to ``isinstance`` checks in scripts and libraries.)"""

    def forward(self, *args, **kwargs):
        self.observer.before_forward(self.global_steps, args, kwargs)
        self._data_efficiency_before_forward()  # random-LTD: the kept-token count of this step
        self.tput_timer.start()
        self.timers.start("forward")
        if self.precision.auto_cast:
            args = cast_inputs(args, self.precision.param_dtype)
            kwargs = cast_inputs(kwargs, self.precision.param_dtype)
        with self.grid.active(), torch_autocast.autocast(self.device, self._autocast_dtype):
            out = self.module(*args, **kwargs)  # (layers called without a group use this engine's grid)
        self.timers.stop("forward")
        return out

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True):
        """Backpropagate ``loss``; gradients are reduced across ranks at accumulation boundaries."""
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ValueError(f"engine.backward(loss) needs a scalar loss tensor, got {_describe(loss)}")
        self.timers.start("backward")
        self._begin_backward()
        self.train_step.scale(loss, divide_by_gas=scale_wrt_gas).backward(retain_graph=retain_graph)
        self._end_backward()
        self.timers.stop("backward")
        self.train_step.record_loss(loss)
        # DeepSpeed's return value: the loss as backpropagated, before loss scaling
        return loss / self.gradient_accumulation_steps() if scale_wrt_gas else loss

    def step(self, lr_kwargs=None) -> None:
        """Count a micro-step; at an accumulation boundary update the weights."""
        self._step_applied = False
        boundary = self.is_gradient_accumulation_boundary()
        if boundary:
            self._check_can_step()
            self.timers.start("step")
        outcome = self.train_step.micro_step(lr_kwargs)
        if outcome is not None:
            self._after_update(outcome)
        self.tput_timer.stop(global_step=boundary)


def _describe(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"a tensor of shape {tuple(x.shape)}"
    return repr(type(x))


DeepSpeedEngine = Engine  # deepspeed.runtime.engine.DeepSpeedEngine
