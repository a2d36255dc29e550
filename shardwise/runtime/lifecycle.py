"""An engine's lifetime: ``destroy()``, and moving its states off the accelerator and back
(``offload_states`` / ``reload_states``), DeepSpeed's ``DeepSpeedEngine`` methods.

Dropping the last reference to an engine frees it and everything it built, ``destroy()`` or not: the hooks
it puts on the model's parameters and modules hold its strategy weakly (and go when it goes), the registries
hold weak references, and nothing global (the active grid, the monitors' exit handlers, the comm logger)
refers to the engine. ``destroy()`` does the same at once, for a caller that keeps the engine or the model:
it takes every hook off the model, releases what ZeRO-3 has gathered, closes the monitors and lets go of the
strategy, its buffers and the process groups; the engine cannot train afterwards.
"""

from __future__ import annotations

import logging
import weakref

from shardwise.zero.offload_states import (
    OffloadDeviceEnum,
    OffloadStatesError,
    OffloadStateTypeEnum,
    StateOffload,
    parse_device,
    parse_include,
)

logger = logging.getLogger("shardwise")

# What the engine adds to the user's optimizer (DeepSpeed's optimizer wrappers carry these).
_OPTIMIZER_ATTRS = ("parameter_offload", "averaged_gradients", "offload_states", "reload_states")


class EngineDestroyedError(RuntimeError):
    """The engine was destroyed (``engine.destroy()``) and cannot run any more."""


class _EngineCall:
    """``optimizer.offload_states(...)`` / ``optimizer.reload_states(...)``: the engine's method, called
    through a weak reference (the optimizer keeps no engine alive). OpenRLHF calls them on the optimizer."""

    def __init__(self, engine, name: str) -> None:
        self._engine, self._name = weakref.ref(engine), name

    def __call__(self, *args, **kwargs):
        engine = self._engine()
        if engine is None:
            raise EngineDestroyedError(f"optimizer.{self._name}(): the engine of this optimizer is gone")
        return getattr(engine, self._name)(*args, **kwargs)


class EngineLifecycleMixin:
    """``destroy``, ``offload_states`` and ``reload_states`` of the engine (see the module docstring)."""

    def _attach_lifecycle(self) -> None:
        """At the end of initialisation: the optimizer answers DeepSpeed's ``offload_states`` /
        ``reload_states`` too, as DeepSpeed's ZeRO optimizers do."""
        optimizer = self.__dict__.get("optimizer")
        if optimizer is not None and int(self.config.zero_optimization.stage) > 0:
            for name in ("offload_states", "reload_states"):
                setattr(optimizer, name, _EngineCall(self, name))

    # -- destroy ------------------------------------------------------------------------------
    def destroy(self) -> None:
        """Take every hook off the model, release ZeRO-3's gathered parameters, close the monitors and drop
        the strategy (gradient and master buffers, optimizer partitions) and the process-group references.
        The model keeps its parameters (under ZeRO-3: partitioned, as DeepSpeed leaves them). Waits for an
        asynchronous checkpoint first. A second call does nothing; training calls afterwards raise."""
        if self.__dict__.get("_destroyed"):
            return
        if self.__dict__.get("_checkpoint_writer") is not None:
            self.wait_for_checkpoint()
        strategy = self.__dict__.get("strategy")
        for s in [strategy, *getattr(strategy, "strategies", ())] if strategy is not None else ():
            partition = getattr(s, "partition", None)
            overlap = getattr(partition, "_overlap", None)
            if overlap is not None:  # an offloaded step still overlapping a backward that never reached step()
                partition._overlap = None
                overlap.cancel()
            for part in ("reducer", "coordinator"):
                closer = getattr(s.__dict__.get(part), "close", None)
                if closer is not None:
                    closer()
        optimizer = self.__dict__.get("optimizer")
        if optimizer is not None:
            for name in _OPTIMIZER_ATTRS:
                optimizer.__dict__.pop(name, None)
        observer = self.__dict__.get("observer")
        if observer is not None:
            if getattr(observer, "flops", None) is not None and observer.flops.started:
                observer.flops.stop_profile()
            observer.monitor.close()
        self.__dict__.pop("_tput_timer", None)
        self.__dict__.pop("_state_offload", None)
        from shardwise import topology

        if topology._DEFAULT[0] is self.__dict__.get("grid"):
            topology._DEFAULT[0] = None  # (the engine's grid stops being the active one)
        train_step = self.__dict__.get("train_step")
        if train_step is not None:  # (it keeps the counters: engine.global_steps still answers)
            train_step.strategy = train_step.lr_scheduler = train_step._grid = None
            train_step._scopes = {}  # (their process groups)
        for name in ("strategy", "optimizer", "observer", "monitor", "grid", "dp_group", "training_dataloader",
                     "_checkpoint_writer", "_compiled_blocks"):
            if name in self.__dict__:
                self.__dict__[name] = None
        self.__dict__["_destroyed"] = True

    def _check_alive(self, what: str) -> None:
        if self.__dict__.get("_destroyed"):
            raise EngineDestroyedError(f"engine.{what}(): this engine was destroyed (engine.destroy()); "
                                       "build a new one with shardwise.initialize")

    # -- offload_states / reload_states ---------------------------------------------------------
    def offload_states(self, include=None, device: OffloadDeviceEnum = OffloadDeviceEnum.cpu, pin_memory: bool = True,
                       non_blocking: bool = False) -> None:
        """Move the engine's states off the accelerator (DeepSpeed's signature). ``include``: which
        ``OffloadStateTypeEnum`` states (None: all of them); ``device``: only ``OffloadDeviceEnum.cpu``;
        ``pin_memory``: page-locked host buffers; ``non_blocking``: asynchronous copies (waited for before
        returning). Call ``reload_states()`` before the next forward (``lp_params``) or backward / step."""
        self._check_alive("offload_states")
        include = parse_include(include)
        device = parse_device(device)
        stage = int(self.config.zero_optimization.stage)
        if stage == 0:
            raise OffloadStatesError("engine.offload_states() needs a ZeRO optimizer: zero_optimization.stage is 0; "
                                     "set stage 1, 2 or 3")
        block = self.config.zero_optimization.offload_param
        if stage == 3 and block is not None and block.device != "none":
            raise OffloadStatesError("Moving states across devices is not supported for offloaded parameters. "
                                     f"(zero_optimization.offload_param.device is '{block.device}')")
        if self.optimizer is None:
            raise OffloadStatesError("Moving states across devices is not supported without an optimizer.")
        if device is OffloadDeviceEnum.none:
            logger.warning("No device specified for offloading states.")
            return
        if device is OffloadDeviceEnum.nvme:
            raise OffloadStatesError("NVMe offload is not supported for offloading states.")
        opt_block = self.config.zero_optimization.offload_optimizer
        if opt_block is not None and opt_block.device != "none":  # (as DeepSpeed: these live off the device already)
            away = {OffloadStateTypeEnum.hp_params, OffloadStateTypeEnum.optim_states}
            if stage == 3:
                away.add(OffloadStateTypeEnum.lp_grads)
            include = [s for s in include if s not in away]
        offload = self.__dict__.setdefault("_state_offload", StateOffload())
        offload.offload(self, include, pin_memory=pin_memory, non_blocking=non_blocking)

    def reload_states(self, non_blocking: bool = False) -> None:
        """Bring back what ``offload_states`` moved, to where it was (bitwise). Nothing offloaded: nothing to do."""
        self._check_alive("reload_states")
        if int(self.config.zero_optimization.stage) > 0 and self.optimizer is None:
            raise OffloadStatesError("Moving states across devices is not supported without an optimizer.")
        offload = self.__dict__.get("_state_offload")
        if offload is not None:
            offload.reload(self, non_blocking=non_blocking)

    @property
    def offloaded_states(self) -> set:
        """The states ``offload_states`` moved and ``reload_states`` has not brought back yet."""
        offload = self.__dict__.get("_state_offload")
        return offload.offloaded() if offload is not None else set()

    def _check_states_loaded(self, what: str, *, forward: bool = False) -> None:
        self._check_alive(what)
        offload = self.__dict__.get("_state_offload")
        if offload is None or not offload.parked:
            return
        away = offload.offloaded()
        if forward:  # a forward needs only the weights
            away &= {OffloadStateTypeEnum.lp_params}
        if away:
            raise OffloadStatesError(f"engine.{what}(): states {sorted(s.value for s in away)} are offloaded "
                                     "(engine.offload_states()); call engine.reload_states() first")
