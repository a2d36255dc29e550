"""The training engines' shared base and ``Engine``, what ``shardwise.initialize`` returns for an
ordinary model.

``Engine`` and ``PipelineEngine`` (``pipe/engine.py``) are siblings over ``EngineBase``: the parts
``runtime/parallelize.py`` builds in one fixed order, the accessors and counters, the boundary update's
bookkeeping, and checkpoints. They differ only in who drives the one ``TrainingStep``
(``runtime/train_step.py``: counters, loss scaling, the accumulation boundary, the clipped update):
``Engine`` from the user's ``forward``/``backward``/``step`` calls, the pipeline from its schedule
(``train_batch``). What a driver calls on the base: ``_begin_backward`` / ``_end_backward`` around
autograd (arm the strategy's hooks / wait for the reductions), ``_check_can_step`` then
``_after_update(outcome)`` around an update (overflow flags, logging, monitors); ``_weights_source``
says where a checkpoint's module weights come from.

The engines hold no stage-specific math: gradient reduction, master weights and the optimizer step live
in a ``ZeroStrategy`` (``shardwise.zero``); the parallel sizes and groups in the grid
(``shardwise/topology.py``); saving in ``shardwise.checkpoint``.
"""

from __future__ import annotations

import abc
import contextlib
import logging
import os
import time

import torch

from shardwise import comm
from shardwise.monitor.mfu import format_rates
from shardwise.precision import cast_inputs
from shardwise.runtime import autocast as torch_autocast
from shardwise.runtime.data_efficiency import DataEfficiencyMixin
from shardwise.runtime.dataloader import build_dataloader
from shardwise.runtime.engine_compat import EngineCompatMixin
from shardwise.runtime.lifecycle import EngineLifecycleMixin
from shardwise.runtime.parallelize import parallelize
from shardwise.runtime.progress import ProgressBar
from shardwise.training_state import StepReport, TrainingState

logger = logging.getLogger("shardwise")

_TIMERS = ["forward", "backward", "backward_allreduce", "step"]


class EngineBase(EngineLifecycleMixin, EngineCompatMixin, DataEfficiencyMixin, torch.nn.Module):
    """The shared half of ``Engine`` and ``PipelineEngine``; see the module docstring."""

    _pipeline = False  # the model is a PipelineModule (parallelize: no AutoTP, tied duplicates out of the norm)
    fault_tolerance = None  # shardwise.ft.engine.FaultTolerance with the fault_tolerance block

    def __init__(self, *, model: torch.nn.Module, config, grid, optimizer=None, model_parameters=None,
                 lr_scheduler=None, training_data=None, collate_fn=None) -> None:
        super().__init__()
        self.config = config
        self.grid = grid  # the one source of sizes and groups
        self._grad_norm: float | None = None
        self._step_skipped = False
        self._last_step_loss: float | None = None
        self._progress: ProgressBar | None = None
        self._checkpoint_writer = None  # created by the first save or load
        parallelize(self, model, pipeline=self._pipeline, optimizer=optimizer, model_parameters=model_parameters,
                    lr_scheduler=lr_scheduler, training_data=training_data, collate_fn=collate_fn)
        self._interval_start = time.perf_counter()
        self._attach_lifecycle()  # (runtime/lifecycle.py: destroy, offload_states)
        if config.fault_tolerance.enabled:  # replica groups on torchft (shardwise/ft): last, it may take a peer's state
            from shardwise.ft.engine import attach

            self.fault_tolerance = attach(self)

    # -- data -------------------------------------------------------------------------------------
    def _seq_dp_rank(self) -> int:
        if self.sequence_parallel_size > 1:
            return self.grid.get_sequence_data_parallel_rank()
        return self.grid.get_data_parallel_rank()

    def deepspeed_io(self, dataset, batch_size=None, route=None, pin_memory=False, data_sampler=None,
                     collate_fn=None, num_local_io_workers=None):
        """A DataLoader giving this data-parallel rank its share of ``dataset``."""
        if data_sampler is None and route in (None, "train") and self.curriculum_learning_enabled():
            return self._curriculum_dataloader(dataset, batch_size or self.train_micro_batch_size_per_gpu(),
                                               collate_fn, pin_memory)
        if data_sampler is not None:
            return torch.utils.data.DataLoader(
                dataset, batch_size=batch_size or self.train_micro_batch_size_per_gpu(),
                sampler=data_sampler, collate_fn=collate_fn, drop_last=self.config.dataloader_drop_last,
            )
        return build_dataloader(
            dataset,
            batch_size=batch_size or self.train_micro_batch_size_per_gpu(),
            dp_world_size=self.seq_dp_world_size,  # with sequence parallelism every rank reads its own samples
            dp_rank=self._seq_dp_rank(),
            collate_fn=collate_fn,
            drop_last=self.config.dataloader_drop_last,
            num_workers=num_local_io_workers or 0,
            pin_memory=pin_memory,
        )

    # -- batch-size accessors -------------------------------------------------------------------
    def train_batch_size(self) -> int:
        return self._batch.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self._batch.train_micro_batch_size_per_gpu

    def gradient_accumulation_steps(self) -> int:
        return self._batch.gradient_accumulation_steps

    def is_gradient_accumulation_boundary(self) -> bool:
        return self.train_step.is_boundary()

    def set_gradient_accumulation_boundary(self, is_boundary: bool | None) -> None:
        """Override whether the coming backward/step is the accumulation boundary (DeepSpeed's method;
        a pipeline engine running its own schedule marks its last micro-batch this way).  ``None``
        returns to counting micro-steps."""
        self.train_step.boundary_override = is_boundary

    # The counters live in the training step (the one writer); DeepSpeed's attribute names read them.
    global_steps = property(lambda self: self.train_step.global_steps,
                            lambda self, v: setattr(self.train_step, "global_steps", v))
    global_samples = property(lambda self: self.train_step.global_samples,
                              lambda self, v: setattr(self.train_step, "global_samples", v))
    micro_steps = property(lambda self: self.train_step.micro_steps,
                           lambda self, v: setattr(self.train_step, "micro_steps", v))
    skipped_steps = property(lambda self: self.train_step.skipped_steps,
                             lambda self, v: setattr(self.train_step, "skipped_steps", v))
    lr_scheduler = property(lambda self: self.train_step.lr_scheduler,  # the step steps it
                            lambda self, v: setattr(self.train_step, "lr_scheduler", v))

    @property
    def enable_backward_allreduce(self) -> bool:
        """Whether backward passes reduce gradients across the data-parallel group (DeepSpeed's
        attribute).  1-bit Adam's strategy variant sets it to False after the warm-up and exchanges
        compressed momentum itself; stage 0 allows that, and stage 1 in the compressed variant
        (``ZeroStrategy.reduce_gradients``, ``can_keep_local_gradients``)."""
        return self.strategy.reduce_gradients

    @enable_backward_allreduce.setter
    def enable_backward_allreduce(self, on: bool) -> None:
        self.strategy.reduce_gradients = on

    # -- what a driver calls around autograd and an update ------------------------------------------
    def _begin_backward(self) -> None:
        """Before autograd runs: arm the strategy's gradient hooks (reduce at the boundary or, for the
        partitioned-gradient stages, every time)."""
        self.train_step.begin_backward()

    def _end_backward(self) -> None:
        """After autograd: wait for the gradient reductions still in flight."""
        self.timers.start("backward_allreduce")
        self.train_step.end_backward()
        self.timers.stop("backward_allreduce")

    def _check_can_step(self) -> None:
        if self.optimizer is None:
            raise ValueError("engine.step() needs an optimizer: add an 'optimizer' block to the config or pass optimizer=")

    def _after_update(self, outcome) -> None:
        """After a boundary update: overflow flags, logging, monitors."""
        self._step_skipped = outcome.overflow
        self._step_applied = not outcome.overflow
        self._grad_norm = outcome.grad_norm
        self._publish_overflow(outcome.overflow)
        if outcome.overflow:
            self._log_overflow(outcome.loss_scale)
        self.timers.stop("step")
        self._last_step_loss = outcome.loss
        self._after_step()

    def _log_overflow(self, scale: float) -> None:
        spp = self.config.steps_per_print or 1
        last = getattr(self, "_overflow_logged_at", None)
        if self.global_rank == 0 and (last is None or self.global_steps - last >= spp):
            self._overflow_logged_at = self.global_steps
            new = self.loss_scaler.loss_scale if self.loss_scaler is not None else scale
            logger.warning(
                "step %d: gradient overflow, step skipped (loss scale %s -> %s, %d skipped so far)",
                self.global_steps - 1, scale, new, self.skipped_steps,
            )

    def _after_step(self) -> None:
        loss = self._last_step_loss
        self.timers.end_step()
        self.observer.after_step(StepReport(
            loss=loss, global_steps=self.global_steps, global_samples=self.global_samples, lr=self.get_lr()[0],
            loss_scale=self.loss_scaler.loss_scale if self.loss_scaler is not None else None,
            grad_norm=self._grad_norm, batch_size=self.train_batch_size(),
            timings=dict(self.timers.last_step) if self.timers.enabled else None))
        if self._progress is not None:
            self._progress.update(step=self.global_steps, loss=loss, lr=self.get_lr()[0], samples=self.train_batch_size(),
                                  rates=self.observer.rates("progress"))
        spp = self.config.steps_per_print
        if spp and self.global_steps % spp == 0:
            self._print_interval(spp, loss)

    def _print_interval(self, steps: int, loss: float | None) -> None:
        now = time.perf_counter()
        rate = steps * self.train_batch_size() / max(now - self._interval_start, 1e-9)
        self._interval_start = now
        rates = self.observer.rates("print")  # tokens/s and MFU (shardwise/monitor/mfu.py)
        if self.global_rank == 0:
            scale = f", loss_scale={self.loss_scaler.loss_scale:g}" if self.loss_scaler is not None else ""
            loss_txt = f"{loss:.6f}" if loss is not None else "n/a"
            logger.info(
                "step=%d, skipped=%d, lr=%s, loss=%s, samples/sec=%.2f%s%s",
                self.global_steps, self.skipped_steps, [f"{x:.4g}" for x in self.get_lr()], loss_txt, rate,
                format_rates(rates), scale,
            )
            if self.timers.enabled:
                logger.info("time: %s", self.timers.summary(_TIMERS, steps=steps))
        if self.config.memory_breakdown:
            logger.info("rank %d %s", self.global_rank, self.memory_breakdown().table())
        self.timers.reset()

    def zero_grad(self) -> None:
        self.strategy.zero_grad()

    @contextlib.contextmanager
    def no_sync(self):
        """Skip gradient reduction for the backward passes inside (accumulate locally)."""
        self.train_step.no_sync_depth += 1
        try:
            yield
        finally:
            self.train_step.no_sync_depth -= 1

    # -- state accessors ------------------------------------------------------------------------
    def get_lr(self) -> list[float]:
        if self.optimizer is None:
            return [0.0]
        return [g["lr"] for g in self.optimizer.param_groups]

    def get_global_grad_norm(self) -> float | None:
        return self._grad_norm

    def was_step_skipped(self) -> bool:
        return self._step_skipped

    def get_loss(self) -> float | None:
        """Mean loss of the last optimizer step's micro-batches on this rank."""
        return self._last_step_loss

    def memory_breakdown(self):
        """Bytes this rank holds for parameters, gradients, master weights and optimizer states,
        next to ZeRO's formula for the configured stage, precision, data-parallel and tensor-parallel size."""
        from shardwise.zero.memory import measure

        dtype = self.precision.param_dtype
        name = {torch.float16: "fp16", torch.bfloat16: "bf16"}.get(dtype, "fp32")
        return measure(self.strategy, self.optimizer, precision=name, weight_bytes=torch.finfo(dtype).bits // 8,
                       tensor_size=self.tp_world_size)

    @property
    def cur_scale(self) -> float:
        return self.loss_scaler.loss_scale if self.loss_scaler is not None else 1.0

    def progress(self, total: int | None = None, desc: str = "train") -> ProgressBar:
        """Attach a rank-0 tqdm bar updated at every optimizer step; use as a context manager."""
        self._progress = ProgressBar(total=total, enabled=self.global_rank == 0, desc=desc)
        return self._progress

    # -- what checkpoint/ and monitor/ see ----------------------------------------------------
    def training_state(self) -> TrainingState:
        """A narrow view of this engine for ``checkpoint/`` and ``monitor/``: its parts, and a copy of
        its counters (only the engine writes them)."""
        return TrainingState(
            module=self.module, strategy=self.strategy, optimizer=self.optimizer, lr_scheduler=self.lr_scheduler,
            loss_scaler=self.loss_scaler, precision=self.precision, config=self.config, dp_group=self.dp_group,
            dp_world_size=self.seq_dp_world_size, global_rank=self.global_rank, device=self.device,
            training_dataloader=self.training_dataloader, grid=self.grid,
            counters=self.train_step.counters())

    @property
    def checkpoint_writer(self):
        """The background writer of asynchronous saves (``checkpoint.writer.decoupled``)."""
        if self._checkpoint_writer is None:
            from shardwise.checkpoint.writer import CheckpointWriter

            self._checkpoint_writer = CheckpointWriter()
        return self._checkpoint_writer

    # -- checkpoints --------------------------------------------------------------------------
    def save_checkpoint(self, save_dir, tag=None, client_state=None, save_latest: bool = True,
                        exclude_frozen_parameters: bool = False):
        """One save path for every layout (``checkpoint/engine_io.py``); only where the module weights
        come from differs (``_weights_source``: None is this rank's module, gathered over tensor ranks)."""
        from shardwise.checkpoint import save_checkpoint

        saved = save_checkpoint(self.training_state(), save_dir, writer=self.checkpoint_writer, tag=tag,
                                client_state=client_state or {}, save_latest=save_latest,
                                exclude_frozen_parameters=exclude_frozen_parameters, weights=self._weights_source())
        self._copy_recovery_script(save_dir)  # zero_to_fp32.py, as DeepSpeed does
        return saved

    def _weights_source(self):
        return None

    def save_16bit_model(self, save_dir, save_filename: str = "model.safetensors",
                         exclude_frozen_parameters: bool = False) -> bool:
        """Write the model's weights, whole, in the training dtype (fp16/bf16/fp32), as safetensors.

        Under ZeRO-3 the weights are gathered one module at a time, which needs
        ``zero_optimization.stage3_gather_16bit_weights_on_model_save: true`` (as in DeepSpeed);
        without it nothing is written and False is returned. Collective: call it on every rank."""
        from shardwise.checkpoint.files import save_state_dict_atomically

        if self.strategy.shards_parameters and \
                not self.config.zero_optimization.stage3_gather_16bit_weights_on_model_save:
            logger.warning("save_16bit_model: not saved, because ZeRO-3 weights are partitioned and "
                           "zero_optimization.stage3_gather_16bit_weights_on_model_save is false")
            return False
        from shardwise.checkpoint import tensor_parallel as tpc

        tp = tpc.view_of(self)
        state = self.strategy.module_state_dict(self.module) \
            if (self.global_rank == 0 or self.strategy.gathers_module_state or tp.active) else None
        if tp.active:  # whole tensors: every tensor rank takes part
            state = tpc.gather_state_dict(state, tp)
        if self.global_rank == 0:
            if exclude_frozen_parameters:
                frozen = {n for n, p in self.module.named_parameters() if not p.requires_grad}
                state = {k: v for k, v in state.items() if k not in frozen}
            save_state_dict_atomically(state, os.path.join(str(save_dir), save_filename))
        comm.barrier()
        return True

    def load_checkpoint(self, load_dir, tag=None, load_module_strict: bool = True, load_optimizer_states: bool = True,
                        load_lr_scheduler_states: bool = True, load_module_only: bool = False, custom_load_fn=None):
        from shardwise.checkpoint import load_checkpoint

        folder, client_state, counters = load_checkpoint(
            self.training_state(), load_dir, writer=self.checkpoint_writer, tag=tag,
            load_module_strict=load_module_strict, load_optimizer_states=load_optimizer_states,
            load_lr_scheduler_states=load_lr_scheduler_states, load_module_only=load_module_only)
        if counters is not None:
            self.train_step.restore(counters)
        if custom_load_fn is not None and folder is not None:
            self._apply_custom_load_fn(folder, custom_load_fn)
        return folder, client_state

    def wait_for_checkpoint(self) -> None:
        """Block until an asynchronous save (``checkpoint.writer.decoupled``) is committed; raise its error.
        Call it on every rank. The next save, a load and interpreter exit wait by themselves."""
        from shardwise.checkpoint.engine_io import wait_for_save

        wait_for_save(self.checkpoint_writer)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            modules = self.__dict__.get("_modules", {})
            if "module" in modules and hasattr(modules["module"], name):
                return getattr(modules["module"], name)
            raise


class Engine(EngineBase, metaclass=abc.ABCMeta):
    """What ``shardwise.initialize`` returns; DeepSpeed's ``DeepSpeedEngine`` API. The constructor is
    ``EngineBase``'s: ``config``, the ``grid`` (sizes and groups), the model and the client objects.
    (``abc.ABCMeta``: ``PipelineEngine`` registers as a virtual subclass, since DeepSpeed's is a
    ``DeepSpeedEngine`` to ``isinstance`` checks in scripts and libraries.)"""

    def forward(self, *args, **kwargs):
        if self.fault_tolerance is not None and self.training:  # the step's quorum, before its first forward
            self.fault_tolerance.before_forward()
        self._check_states_loaded("forward", forward=True)
        self.observer.before_forward(self.global_steps, args, kwargs)
        self._data_efficiency_before_forward()  # random-LTD: the kept-token count of this step
        self.tput_timer.start()
        self.timers.start("forward")
        if self.precision.auto_cast:
            args = cast_inputs(args, self.precision.param_dtype)
            kwargs = cast_inputs(kwargs, self.precision.param_dtype)
        with self.grid.active():  # (layers called without a group use this engine's grid)
            if self._autocast_dtype is None:
                out = self.module(*args, **kwargs)
            else:  # the torch_autocast block
                with torch_autocast.autocast(self.device, self._autocast_dtype):
                    out = self.module(*args, **kwargs)
        self.timers.stop("forward")
        return out

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True):
        """Backpropagate ``loss``; gradients are reduced across ranks at accumulation boundaries."""
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ValueError(f"engine.backward(loss) needs a scalar loss tensor, got {_describe(loss)}")
        self._check_states_loaded("backward")
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
        self._check_states_loaded("step")
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
