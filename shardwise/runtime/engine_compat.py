"""DeepSpeed's engine accessors that real scripts call (``DeepSpeedEngine`` API surface).

A mixin so ``engine.py`` keeps to sequencing the step: everything here reads the config,
the engine's counters or its strategy. Names, arguments and return values are DeepSpeed's.
"""

from __future__ import annotations

import inspect
import logging
import time

import torch

from shardwise import comm
from shardwise.config.batch import BatchSizes

logger = logging.getLogger("shardwise")

_DEEPSPEED_OPTIMIZERS = {"adagrad", "adam", "adamw", "lamb", "onebitadam", "zerooneadam", "onebitlamb", "lion",
                         "muon"}


class ZeroSetupError(ValueError):
    """A ZeRO setup refused at initialize, as DeepSpeed refuses it with ``ZeRORuntimeException`` (which
    is this class under the compat package): ``zero_force_ds_cpu_optimizer: true`` with the optimizer
    offloaded and a client optimizer that is not ``DeepSpeedCPUAdam`` / ``DeepSpeedCPULion``."""


def check_forced_cpu_optimizer(config, optimizer):
    """DeepSpeed refuses a client optimizer other than its CPU Adam/Lion for an offloaded optimizer when
    ``zero_force_ds_cpu_optimizer`` is true (its default), for speed. shardwise's CPU optimizers run the
    same torch kernels as any torch optimizer, so it refuses only where the config sets the key true."""
    block = config.zero_optimization.offload_optimizer
    if ("zero_force_ds_cpu_optimizer" not in config.model_fields_set or not config.zero_force_ds_cpu_optimizer
            or config.zero_optimization.stage == 0 or block is None or block.device not in ("cpu", "nvme")):
        return optimizer
    from shardwise.ops.adam import DeepSpeedCPUAdam
    from shardwise.ops.lion import DeepSpeedCPULion

    if not isinstance(optimizer, (DeepSpeedCPUAdam, DeepSpeedCPULion)):
        raise ZeroSetupError(
            f"zero_force_ds_cpu_optimizer is true and zero_optimization.offload_optimizer.device is '{block.device}', "
            f"but the optimizer passed to initialize() is {type(optimizer).__name__}: pass DeepSpeedCPUAdam "
            "(shardwise.ops.adam) or DeepSpeedCPULion, put an 'optimizer' block in the config, or set "
            "zero_force_ds_cpu_optimizer: false")
    return optimizer


class ThroughputTimer:
    """``engine.tput_timer`` (DeepSpeed's ``ThroughputTimer``): samples per second over optimizer
    steps, leaving out the first ``start_step`` steps (warm-up). The engine starts it in forward
    and stops it in ``step()``. ``enabled=False`` (config ``timers.throughput.enabled``) makes both no-ops."""

    def __init__(self, batch_size: int, start_step: int = 2, steps_per_output=None, monitor_memory=False,
                 logging_fn=None, synchronize=None, *, enabled: bool = True) -> None:
        self.enabled = enabled
        self.batch_size = batch_size or 1
        self.start_step = start_step
        self.steps_per_output = steps_per_output
        self.monitor_memory = monitor_memory
        self.logging = logging_fn or logger.info
        self._synchronize = synchronize or (lambda: None)
        self.epoch_count = 0
        self.micro_step_count = 0
        self.global_step_count = 0
        self.total_elapsed_time = 0.0
        self.step_elapsed_time = 0.0
        self.start_time = 0.0
        self.end_time = 0.0
        self.started = False
        self.initialized = False  # True from the first start()

    def update_epoch_count(self) -> None:
        self.epoch_count += 1
        self.micro_step_count = 0

    def start(self) -> None:
        if not self.enabled or self.started:
            return  # several forwards before one step (e.g. generation in the loop): timed from the first
        self.initialized = self.started = True
        if self.global_step_count >= self.start_step:
            self._synchronize()
            self.start_time = time.time()

    def stop(self, global_step: bool = False, report_speed: bool = True) -> None:
        if not self.started:
            return
        self.started = False
        self.micro_step_count += 1
        if global_step:
            self.global_step_count += 1
        if self.start_time > 0:  # (0 during the warm-up steps; start() sets it after them)
            self._synchronize()
            self.end_time = time.time()
            duration = self.end_time - self.start_time
            self.total_elapsed_time += duration
            self.step_elapsed_time += duration
            if global_step:
                if report_speed and self.steps_per_output and self.global_step_count % self.steps_per_output == 0:
                    self.logging(f"epoch={self.epoch_count}/micro_step={self.micro_step_count}/"
                                 f"global_step={self.global_step_count}, "
                                 f"RunningAvgSamplesPerSec={self.avg_samples_per_sec()}, "
                                 f"CurrSamplesPerSec={self.batch_size / max(self.step_elapsed_time, 1e-9)}")
                self.step_elapsed_time = 0.0

    def avg_samples_per_sec(self) -> float:
        """Mean samples per second over the timed steps; ``-inf`` before any step (as DeepSpeed)."""
        timed = self.global_step_count - self.start_step
        if self.global_step_count > 0 and timed > 0 and self.total_elapsed_time > 0:
            return self.batch_size / (self.total_elapsed_time / timed)
        return float("-inf")


class EngineCompatMixin:
    """DeepSpeed accessors on the engine; see the class docstring of the module."""

    # -- config questions ---------------------------------------------------------------------
    def zero_optimization_stage(self) -> int:
        return int(self.config.zero_optimization.stage)

    def zero_optimization(self) -> bool:
        return self.zero_optimization_stage() > 0

    def zero_optimization_partition_gradients(self) -> bool:
        return self.zero_optimization_stage() >= 2

    def zero_optimization_partition_weights(self) -> bool:
        return self.zero_optimization_stage() >= 3

    def zero_offload_optimizer(self):
        """The ``offload_optimizer`` block, or None when the optimizer is not offloaded."""
        block = self.config.zero_optimization.offload_optimizer
        return block if block is not None and block.device != "none" else None

    def zero_offload_param(self):
        block = self.config.zero_optimization.offload_param
        return block if block is not None and block.device != "none" else None

    def zero_cpu_offload(self) -> bool:
        block = self.zero_offload_optimizer()
        return block is not None and block.device == "cpu"

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        return bool(self.config.zero_optimization.stage3_gather_16bit_weights_on_model_save)

    def zero_reduce_bucket_size(self) -> int:
        return int(self.config.zero_optimization.reduce_bucket_size)

    def zero_allgather_bucket_size(self) -> int:
        return int(self.config.zero_optimization.allgather_bucket_size)

    def autotp_size(self) -> int:
        """``tensor_parallel.autotp_size`` (0: AutoTP off), as DeepSpeed's engine answers."""
        return int(self.config.tensor_parallel.autotp_size)

    def fp16_enabled(self) -> bool:
        return bool(self.config.fp16.enabled)

    def bfloat16_enabled(self) -> bool:
        return bool(self.config.bf16.enabled)

    def fp16_auto_cast(self) -> bool:
        return bool(self.config.fp16.auto_cast)

    def torch_autocast_enabled(self) -> bool:
        return bool(self.config.torch_autocast.enabled)

    def torch_autocast_dtype(self) -> torch.dtype:
        return {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[self.config.torch_autocast.dtype]

    def torch_autocast_lower_precision_safe_modules(self) -> list[str]:
        return list(self.config.torch_autocast.lower_precision_safe_modules)

    def gradient_clipping(self) -> float:
        return self.config.gradient_clipping

    def steps_per_print(self):
        return self.config.steps_per_print

    def wall_clock_breakdown(self) -> bool:
        return bool(self.config.wall_clock_breakdown)

    def optimizer_name(self):
        """The client optimizer's class name, else the config's ``optimizer.type``."""
        if getattr(self, "client_optimizer", None) is not None:
            return type(self.client_optimizer).__name__
        if self.config.optimizer is None:
            return None
        name = self.config.optimizer.type
        return name.lower() if name.lower() in _DEEPSPEED_OPTIMIZERS else name  # DeepSpeed lower-cases its own

    def scheduler_name(self):
        return self.config.scheduler.type if self.config.scheduler is not None else None

    # -- parallel layout ------------------------------------------------------------------------
    def get_data_parallel_rank(self) -> int:
        return self.grid.get_data_parallel_rank()

    def get_data_parallel_world_size(self) -> int:
        return self.dp_world_size

    def get_data_parallel_group(self):
        return self.dp_group

    def get_model_parallel_rank(self) -> int:
        getter = getattr(self.grid, "get_model_parallel_rank", None)
        return getter() if getter is not None else 0

    def get_model_parallel_world_size(self) -> int:
        getter = getattr(self.grid, "get_model_parallel_world_size", None)
        return getter() if getter is not None else 1

    # -- batch size and accumulation -----------------------------------------------------------
    def set_train_batch_size(self, train_batch_size: int) -> None:
        """Change the global batch size by changing the gradient accumulation steps (the
        micro-batch stays). ``train_batch_size`` must divide by micro-batch * data-parallel size."""
        micro = self.train_micro_batch_size_per_gpu()
        if train_batch_size % (micro * self.dp_world_size) != 0:
            raise ValueError(f"set_train_batch_size({train_batch_size}): not divisible by "
                             f"train_micro_batch_size_per_gpu ({micro}) * data-parallel size ({self.dp_world_size})")
        self._batch = BatchSizes(train_batch_size, micro, train_batch_size // (micro * self.dp_world_size))
        self.train_step.batch = self._batch
        if getattr(self, "_tput_timer", None) is not None:
            self._tput_timer.batch_size = train_batch_size

    def set_train_micro_batch_size(self, micro_batch_size: int) -> None:
        gas = self.gradient_accumulation_steps()
        self._batch = BatchSizes(micro_batch_size * gas * self.dp_world_size, micro_batch_size, gas)
        self.train_step.batch = self._batch

    def allreduce_gradients(self, bucket_size=None) -> None:
        """DeepSpeed's reduction of the gradients over the data-parallel group, which its ``backward`` calls at
        the accumulation boundary. shardwise's ``backward`` reduces them itself (at the boundary; every
        backward under ZeRO-2/3) and waits for the reductions, so after it nothing is left to reduce.
        ``bucket_size`` is accepted for DeepSpeed's signature (the buckets are ``reduce_bucket_size``)."""
        if not self.enable_backward_allreduce:
            raise ValueError("engine.allreduce_gradients(): the gradient reduction is switched off "
                             "(engine.enable_backward_allreduce is False: the optimizer exchanges them itself)")

    def was_step_applied(self) -> bool:
        """True if the last ``step()`` updated the weights (a boundary without overflow)."""
        return bool(getattr(self, "_step_applied", False))

    def _publish_overflow(self, overflow: bool) -> None:
        """``optimizer.overflow``: DeepSpeed's optimizer wrappers carry it, and accelerate reads it (when
        the attribute exists) to skip its own LR-scheduler step after a step skipped for an fp16 overflow."""
        if self.optimizer is not None:
            self.optimizer.overflow = bool(overflow)

    def compile(self, backend=None, compile_kwargs=None, schedule=None, compiled_autograd_enabled=False) -> None:
        """DeepSpeed's ``engine.compile``: ``torch.compile`` the model's repeated blocks (else the whole
        model) with ``backend`` (default: the accelerator's, ``inductor``) and ``compile_kwargs``, keeping
        ZeRO's hooks outside the compiled graphs (``runtime/compile.py``, docs/compile.md). A second
        call does nothing. DeepCompile's ``schedule`` and compiled autograd are refused by name."""
        from shardwise.runtime.compile import check_backend, compile_model

        if schedule is not None:
            raise ValueError("engine.compile(schedule=...) is a DeepCompile pass schedule; DeepCompile is not "
                             "implemented by shardwise: call engine.compile() without a schedule")
        if compiled_autograd_enabled:
            raise ValueError("engine.compile(compiled_autograd_enabled=True) is not supported: the backward of "
                             "each compiled block is compiled already, and ZeRO's gradient hooks stay eager")
        if self.is_compiled:
            return
        kwargs = dict(compile_kwargs or {})
        if "backend" in kwargs:
            logger.warning("engine.compile: 'backend' in compile_kwargs is ignored; pass backend= instead")
            kwargs.pop("backend")
        known = set(inspect.signature(torch.compile).parameters) - {"model", "backend"}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"engine.compile: compile_kwargs (config compile.kwargs) has {unknown}, which "
                             f"torch.compile does not take; it takes {sorted(known)}")
        if backend is None:
            from shardwise.accelerator import get_accelerator

            backend = get_accelerator().get_compile_backend()
        check_backend(backend, device=self.device)
        coordinator = self.strategy.coordinator if self.strategy.shards_parameters else None
        self._compiled_blocks = compile_model(self.module, backend=backend, kwargs=kwargs, coordinator=coordinator)

    @property
    def is_compiled(self) -> bool:
        """True once ``compile()`` ran (DeepSpeed's property)."""
        return bool(self.__dict__.get("_compiled_blocks"))

    # -- throughput ---------------------------------------------------------------------------------
    @property
    def tput_timer(self) -> ThroughputTimer:
        timer = self.__dict__.get("_tput_timer")
        if timer is None:
            settings = self.config.timers.throughput
            sync = settings.synchronized and self.device.type != "cpu"
            timer = ThroughputTimer(self.train_batch_size(), steps_per_output=self.config.steps_per_print,
                                    synchronize=torch.accelerator.synchronize if sync else None,
                                    enabled=settings.enabled)
            self.__dict__["_tput_timer"] = timer
        return timer

    # -- ZeRO-3 export -------------------------------------------------------------------------------
    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False):
        """The whole model's state dict in the training dtype, on CPU, on rank 0 (None elsewhere).
        Collective: call it on every rank. Needs ZeRO-3, as in DeepSpeed."""
        if not self.zero_optimization_partition_weights():
            raise ValueError("_zero3_consolidated_16bit_state_dict() requires ZeRO-3 "
                             f"(zero_optimization.stage is {self.zero_optimization_stage()})")
        state = self.strategy.module_state_dict(self.module)
        if comm.get_rank() != 0:
            return None
        if exclude_frozen_parameters:
            frozen = {n for n, p in self.module.named_parameters() if not p.requires_grad}
            state = {k: v for k, v in state.items() if k not in frozen}
        return {k: v.detach().cpu() for k, v in state.items()}

    def module_state_dict(self, destination=None, prefix="", keep_vars=False, exclude_frozen_parameters=False):
        """The model's state dict (gathered under ZeRO-3: collective there)."""
        state = self.strategy.module_state_dict(self.module)
        if exclude_frozen_parameters:
            frozen = {n for n, p in self.module.named_parameters() if not p.requires_grad}
            state = {k: v for k, v in state.items() if k not in frozen}
        return {prefix + k: v for k, v in state.items()}

    def empty_partition_cache(self) -> None:
        """Release the ZeRO-3 parameters still gathered (persistent ones, those kept for reuse) to free
        their memory; they are gathered again when next used. Nothing to do below stage 3."""
        for strategy in [self.strategy, *getattr(self.strategy, "strategies", ())]:  # (MoE: each part's)
            coordinator = getattr(strategy, "coordinator", None) if strategy.shards_parameters else None
            if coordinator is not None:
                coordinator.release_all()

    # -- checkpoints ----------------------------------------------------------------------------------
    def _apply_custom_load_fn(self, folder, custom_load_fn) -> None:
        """``load_checkpoint(custom_load_fn=fn)``: ``fn(src=<checkpoint's module state dict>,
        dst=<model>)`` runs on every rank with the model's parameters whole (rank 0's result is
        kept under ZeRO-3), and the fp32 master weights are then set from the model's weights."""
        from shardwise.checkpoint import open_checkpoint
        from shardwise.utils.set_full import safe_set_full_fp32_param
        from shardwise.zero import GatheredParameters

        ckpt = open_checkpoint(folder)
        if ckpt is None:
            raise NotImplementedError(f"load_checkpoint(custom_load_fn=...): {folder} is in DeepSpeed's own layout; "
                                      "convert it first (shardwise convert --from-deepspeed DIR OUT) and load OUT")
        src = ckpt.read("model.safetensors")
        for alias, name in ckpt.manifest.get("aliases", {}).items():
            if name in src:
                src[alias] = src[name]
        params = list(self.module.parameters())
        with torch.no_grad(), GatheredParameters(params, modifier_rank=0):
            custom_load_fn(src=src, dst=self.module)
            if not self.zero_optimization_partition_weights():  # ZeRO-3 refreshes its masters on exit
                for p in params:
                    if p.requires_grad:
                        safe_set_full_fp32_param(p, p.detach())

    def _copy_recovery_script(self, save_dir) -> None:
        """Rank 0 puts ``zero_to_fp32.py`` (stand-alone: torch and safetensors only) beside the
        checkpoints, as DeepSpeed does; every rank returns once it is there."""
        if comm.get_rank() == 0:
            import os
            import shutil

            import shardwise.utils.zero_to_fp32 as script

            target = os.path.join(str(save_dir), "zero_to_fp32.py")
            tmp = target + ".tmp"
            shutil.copyfile(script.__file__, tmp)
            os.chmod(tmp, 0o755)
            os.replace(tmp, target)
        comm.barrier()
