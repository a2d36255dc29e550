"""The training engine: sequences forward, backward, step and checkpoints.

The engine holds no stage-specific math.  Gradient reduction, master weights and the
optimizer step live in a ``ZeroStrategy`` (``shardwise.zero``); counters, loss scaling, the
accumulation boundary and the clipped update in the ``TrainingStep`` it shares with the pipeline
(``runtime/train_step.py``); the parallel sizes in its validated ``ParallelDims`` (``runtime/plan.py``);
saving in ``shardwise.checkpoint``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import time

import torch

from shardwise import checkpointing, comm
from shardwise.moe import parallel as moe_parallel
from shardwise.moe.utils import has_moe_layers, is_moe_param
from shardwise.monitor.mfu import format_rates
from shardwise.monitor.observer import StepObserver
from shardwise.precision import PrecisionPolicy, cast_inputs, create_loss_scaler
from shardwise.runtime import autocast as torch_autocast
from shardwise.runtime.data_efficiency import DataEfficiencyMixin
from shardwise.runtime.dataloader import build_dataloader
from shardwise.runtime.engine_compat import EngineCompatMixin, check_forced_cpu_optimizer
from shardwise.runtime.lifecycle import EngineLifecycleMixin
from shardwise.runtime.module_dtypes import cast_buffers, cast_parameters, keep_in_fp32_pattern
from shardwise.runtime.plan import config_features, optimizer_features
from shardwise.runtime.progress import ProgressBar
from shardwise.runtime.timers import Timers
from shardwise.runtime.tp_sequence_grads import sync_sequence_parallel_grads
from shardwise.runtime.train_step import TrainingStep
from shardwise.training_state import StepReport, TrainingState
from shardwise.utils.z3_leaf_module import apply_leaf_module_config
from shardwise.zero import ReduceSettings, build_strategy, is_partitioned
from shardwise.zero import registry as zero_registry

logger = logging.getLogger("shardwise")

def _check_muon(config) -> None:
    zc = config.zero_optimization
    if zc.stage > 0 and zc.offload_optimizer is not None and zc.offload_optimizer.device != "none":
        raise ValueError("optimizer.type=Muon with zero_optimization.offload_optimizer: not implemented yet "
                         "(the offloaded step runs sub-group by sub-group; Muon needs every matrix at once)")


_COMM_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
_TIMERS = ["forward", "backward", "backward_allreduce", "step"]


class Engine(EngineLifecycleMixin, EngineCompatMixin, DataEfficiencyMixin, torch.nn.Module):
    """What ``shardwise.initialize`` returns; DeepSpeed's ``DeepSpeedEngine`` API."""

    def __init__(
        self,
        *,
        model: torch.nn.Module,
        config,
        grid,
        dims=None,
        optimizer=None,
        model_parameters=None,
        lr_scheduler=None,
        training_data=None,
        collate_fn=None,
    ) -> None:
        super().__init__()
        self.config = config
        self.grid = grid
        # Batch arithmetic counts data-parallel replicas (world / sequence-parallel size); ZeRO shards and
        # reduces over every data x sequence rank, DeepSpeed's sequence-data-parallel group, averaging
        # over all of them (docs/sequence-parallel.md says why that gives one process's gradient).
        self.sequence_parallel_size = getattr(grid, "get_sequence_parallel_world_size", lambda: 1)()
        self.dp_world_size = grid.get_data_parallel_world_size()
        self.tp_world_size = _tensor_size(grid)
        if self.sequence_parallel_size > 1:
            self.dp_group = grid.get_sequence_data_parallel_group()
            self.seq_dp_world_size = grid.get_sequence_data_parallel_world_size()
        else:
            self.dp_group = grid.get_data_parallel_group()
            self.seq_dp_world_size = self.dp_world_size
        self.global_rank = comm.get_rank()
        self.world_size = comm.get_world_size()
        self.local_rank = comm.get_local_rank()
        self.device = comm.get_accelerator_device(self.local_rank)
        self._batch = config.resolve_batch_sizes(self.dp_world_size)
        config.check_supported()

        if dims is None:  # built directly (initialize plans and validates before it builds the grid)
            dims = grid.dims.replace(**config_features(config, model=model)).validate(comm.get_world_size())
        self.dims = dims
        _check_tensor_parallel_layers(model, self.tp_world_size)
        self.module = model.to(self.device)
        self.has_moe_layers, self.num_experts = has_moe_layers(self.module)
        if self.has_moe_layers or self.dims.pipe > 1:  # the expert groups, before the experts' start weights
            with grid.active():  # are broadcast (a pipeline: on every stage, whether it has MoE layers or not)
                moe_parallel.configure(self.module, across_stages=self.dims.pipe > 1)
        if self.tp_world_size > 1:  # norms/biases on sequence shards: sum their gradients over the tensor ranks
            sync_sequence_parallel_grads(self.module, grid.get_tensor_model_parallel_group())
        self.precision = PrecisionPolicy.from_config(config)
        self._autocast_dtype = self._configure_autocast()
        self._broadcast_model()
        self._cast_module()

        self.optimizer = self._configure_optimizer(optimizer, model_parameters)
        if self.dims.compressed_optimizer is None and getattr(self.optimizer, "compressed_communication", False):
            self.dims = self.dims.replace(**optimizer_features(self.optimizer)).validate()  # built by a callable
        build = functools.partial(build_strategy, config.zero_optimization, aio=config.aio, module=self.module,
                                  precision=self.precision, dims=self.dims, reduce=self._reduce_settings())
        named_params = list(self.module.named_parameters())
        if int(config.zero_optimization.stage) == 3:  # MoE blocks that run only their tokens' experts: gathered whole
            apply_leaf_module_config(self.module, config.zero_optimization.leaf_module)
        if self.has_moe_layers:  # expert parameters reduce over their expert-data-parallel group
            self.strategy = moe_parallel.build_strategy(build, module=self.module, named_params=named_params,
                                                        optimizer=self.optimizer, dp_group=self.dp_group,
                                                        zero_stage=int(config.zero_optimization.stage))
        else:
            self.strategy = build(named_params=named_params, optimizer=self.optimizer, dp_group=self.dp_group)
        scheduler = self._configure_scheduler(lr_scheduler)
        self._publish_overflow(False)
        self.loss_scaler = create_loss_scaler(config.fp16) if self.precision.loss_scaling else None
        for s in [self.strategy, *getattr(self.strategy, "strategies", ())]:  # (MoE: each part's)
            zero_registry.set_loss_scaler(s, self.loss_scaler)  # for shardwise.utils.safe_get_full_grad

        self.training_dataloader = None
        if training_data is not None:
            self.training_dataloader = self.deepspeed_io(training_data, collate_fn=collate_fn)

        self.train_step = TrainingStep(
            strategy=self.strategy, loss_scaler=self.loss_scaler, lr_scheduler=scheduler,
            gradient_accumulation_steps=self.gradient_accumulation_steps, train_batch_size=self.train_batch_size,
            grid=grid, module=self.module, norm_skip=self._norm_skip(), device=self.device,
            clip=float(config.gradient_clipping or 0.0), check_overflow=self.precision.check_overflow)
        self._grad_norm: float | None = None
        self._step_skipped = False
        self._last_step_loss: float | None = None
        self.timers = Timers(self.device, enabled=bool(config.wall_clock_breakdown))
        self._interval_start = time.perf_counter()
        self._progress: ProgressBar | None = None
        _check_partitioned_activations(config, self.module, self.tp_world_size)
        checkpointing.configure_from(config, mpu=grid)  # activation_checkpointing block, if set
        self._checkpoint_writer = None  # created by the first save or load
        self.observer = StepObserver(self.training_state(), autotuning_engine=self)  # monitors, flops, autotuning
        self.monitor = self.observer.monitor
        if config.compile.enabled:  # ours: the compile block compiles at initialize
            self.compile(backend=config.compile.backend, compile_kwargs=config.compile.kwargs)
        self._attach_lifecycle()  # (runtime/lifecycle.py: destroy, offload_states)

    # -- set-up ---------------------------------------------------------------------------
    def _configure_autocast(self) -> torch.dtype | None:
        """``torch_autocast``: the dtype the forward autocasts to (None when the block is off)."""
        block = self.config.torch_autocast
        if not block.enabled:
            return None
        dtype = torch_autocast.DTYPES[block.dtype]
        torch_autocast.mark_lower_precision_params(self.module, dtype, block.lower_precision_safe_modules)
        return dtype

    def _broadcast_model(self) -> None:
        """Every data-parallel replica starts from data-parallel rank 0's weights and buffers
        (parameters ``zero.Init`` partitioned were broadcast when they were sharded)."""
        if self.seq_dp_world_size == 1:
            return
        src = 0 if self.dp_group is None else torch.distributed.get_global_rank(self.dp_group, 0)
        params = [p for p in self.module.parameters() if not is_partitioned(p) and not is_moe_param(p)]
        with torch.no_grad():
            for t in params + list(self.module.buffers()):
                comm.broadcast(t.data, src=src, group=self.dp_group)
        if self.has_moe_layers:  # each expert from the first rank of its expert-data-parallel group
            moe_parallel.broadcast_experts(self.module)

    def _cast_module(self) -> None:
        """Frozen parameters to the training dtype (the strategy casts the trainable ones); buffers keep
        their dtype unless ``data_types.buffer_dtype`` is set (runtime/module_dtypes.py)."""
        dtype = self.precision.param_dtype
        keep = keep_in_fp32_pattern(self.module, self.config.data_types.keep_in_fp32_modules, dtype)
        cast_buffers(self.module, self.precision.buffer_dtype, keep_fp32=keep)
        if dtype != torch.float32:
            cast_parameters((p for p in self.module.parameters() if not p.requires_grad), dtype)

    def _configure_optimizer(self, client_optimizer, model_parameters):
        cfg_opt = self.config.optimizer
        if client_optimizer is not None and cfg_opt is not None:
            raise ValueError(
                "both an optimizer passed to initialize() and an 'optimizer' block in the config: "
                "remove one of them"
            )
        params = model_parameters if model_parameters is not None else self.module.parameters()
        if client_optimizer is not None:
            if isinstance(client_optimizer, torch.optim.Optimizer):
                return check_forced_cpu_optimizer(self.config, client_optimizer)
            if callable(client_optimizer):
                return check_forced_cpu_optimizer(self.config, client_optimizer(params))
            raise ValueError(f"optimizer must be a torch.optim.Optimizer or a callable, got {type(client_optimizer)!r}")
        if cfg_opt is None:
            return None
        from shardwise.optim import build_optimizer

        if cfg_opt.type.lower() == "muon":
            _check_muon(self.config)
            from shardwise.optim.muon import tag_muon_params
            tag_muon_params(self.module)  # DeepSpeed's split, where the user set no p.use_muon
        return build_optimizer(cfg_opt.type, dict(cfg_opt.params or {}), params)

    def _configure_scheduler(self, client_scheduler):
        cfg_sched = self.config.scheduler
        if client_scheduler is not None and cfg_sched is not None:
            raise ValueError(
                "both an lr_scheduler passed to initialize() and a 'scheduler' block in the config: "
                "remove one of them"
            )
        if client_scheduler is not None:
            if callable(client_scheduler) and not hasattr(client_scheduler, "step"):
                return client_scheduler(self.optimizer)
            return client_scheduler
        if cfg_sched is None:
            return None
        if self.optimizer is None:
            raise ValueError("a 'scheduler' block needs an optimizer (config 'optimizer' or initialize(optimizer=...))")
        from shardwise.optim import build_scheduler

        return build_scheduler(cfg_sched.type, dict(cfg_sched.params or {}), self.optimizer)

    def _reduce_settings(self) -> ReduceSettings:
        c = self.config
        return ReduceSettings(
            bucket_elements=int(c.zero_optimization.reduce_bucket_size),
            bucket_size_given="reduce_bucket_size" in c.zero_optimization.model_fields_set,
            average=c.gradient_allreduce_op == "mean",
            prescale=bool(c.prescale_gradients),
            predivide_factor=float(c.gradient_predivide_factor),
            comm_dtype=_COMM_DTYPES[self._comm_dtype_key()] if self._comm_dtype_key() else None,
        )

    def _comm_dtype_key(self):
        # as DeepSpeed: under sequence parallelism gradients are reduced in seq_parallel_communication_data_type
        if self.sequence_parallel_size > 1:
            return self.config.seq_parallel_communication_data_type
        return self.config.communication_data_type

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

    # -- training step ------------------------------------------------------------------------
    def forward(self, *args, **kwargs):
        self._check_states_loaded("forward", forward=True)
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
        self._check_states_loaded("backward")
        self.timers.start("backward")
        self._begin_backward()
        self.train_step.scale(loss, divide_by_gas=scale_wrt_gas).backward(retain_graph=retain_graph)
        self._end_backward()
        self.timers.stop("backward")
        self.train_step.record_loss(loss)
        # DeepSpeed's return value: the loss as backpropagated, before loss scaling
        return loss / self.gradient_accumulation_steps() if scale_wrt_gas else loss

    def _begin_backward(self) -> None:
        """Before autograd runs: arm the strategy's gradient hooks (reduce at the boundary or, for the
        partitioned-gradient stages, every time).  A subclass running its own schedule (pipeline)
        calls this and ``_end_backward`` around its own ``torch.autograd.backward``."""
        self.train_step.begin_backward()

    def _end_backward(self) -> None:
        """After autograd: wait for the gradient reductions still in flight."""
        self.timers.start("backward_allreduce")
        self.train_step.end_backward()
        self.timers.stop("backward_allreduce")

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

    def _norm_skip(self) -> frozenset[str]:
        """Names of parameters whose gradients another rank counts in the norm (tied duplicates)."""
        return frozenset()

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


def _check_tensor_parallel_layers(model: torch.nn.Module, tp: int) -> None:
    """Tensor-parallel layers cut themselves over the grid active when they are built: one built
    outside the grid's scope (or for another grid) holds the wrong pieces."""
    from shardwise.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding

    for name, m in model.named_modules():
        if isinstance(m, (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding)) and m.world_size != tp:
            raise ValueError(f"layer '{name}' ({type(m).__name__}) was built for tensor size {m.world_size} but the "
                             f"engine's grid has tensor size {tp}: build the model inside `with grid.active():` "
                             "and pass initialize(mpu=grid) the grid it was built on")


def _check_partitioned_activations(config, module: torch.nn.Module, tp: int) -> None:
    """partition_activations cuts each checkpointed input over the tensor ranks as if they all held the same
    one; under Megatron's sequence parallelism they hold different sequence slices (trains wrong: refused)."""
    block = config.activation_checkpointing
    if tp > 1 and block is not None and block.partition_activations and \
            any(getattr(p, "sequence_parallel", False) for p in module.parameters()):
        raise ValueError("activation_checkpointing.partition_activations with Megatron sequence parallelism (parameters "
                         "marked sequence_parallel=True, e.g. GPTConfig(sequence_parallel=True)) is not supported: the "
                         "checkpointed inputs are already cut over the tensor ranks. Use one of them")


def _tensor_size(grid) -> int:
    getter = getattr(grid, "get_tensor_model_parallel_world_size", None)
    return int(getter()) if getter is not None else 1


def _describe(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"a tensor of shape {tuple(x.shape)}"
    return repr(type(x))


DeepSpeedEngine = Engine  # deepspeed.runtime.engine.DeepSpeedEngine
