"""``deepspeed.runtime.config``: ``DeepSpeedConfig`` as a view of shardwise's validated config
(``shardwise.config.load_config``): DeepSpeed's attribute names read the same values, and the batch
triad is resolved with shardwise's rule (``shardwise.config.batch.resolve_batch_sizes``)."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from shardwise import comm
from shardwise.config import load_config
from shardwise.config.batch import resolve_batch_sizes
from shardwise.config.errors import ConfigError
from shardwise.config.loader import read_config_file

from .constants import GRADIENT_CLIPPING, GRADIENT_CLIPPING_DEFAULT


def get_gradient_clipping(param_dict: dict) -> float:
    return param_dict.get(GRADIENT_CLIPPING, GRADIENT_CLIPPING_DEFAULT)


class DeepSpeedConfig:
    """``DeepSpeedConfig(config, mpu=None)``: ``config`` a path to a JSON (or hjson) file or a dict. Problems in it raise
    ``shardwise.config.ConfigError`` (a ValueError). The data-parallel size is the world size over the
    model-parallel size of ``mpu`` (1 without a process group)."""

    def __init__(self, config: str | os.PathLike | dict, mpu=None, mesh_device=None) -> None:
        param_dict = config if isinstance(config, dict) else read_config_file(Path(config))
        self._param_dict = param_dict
        self._config = load_config(param_dict if isinstance(config, dict) else config)
        if self._config.gradient_allreduce_op == "sum" and self._config.zero_optimization.stage == 3:
            # DeepSpeed's ZeRO-3 reduce-scatter only averages, so its config refuses the pair; shardwise's
            # engine runs it (deepspeed.initialize with this config does), DeepSpeed's config class does not.
            raise ValueError("gradient_allreduce_op='sum' is not supported with ZeRO stage 3")
        world = comm.get_world_size() if comm.is_initialized() else 1
        mp = mpu.get_model_parallel_world_size() if mpu is not None else 1
        self.world_size = world // mp
        sizes = self._config.resolve_batch_sizes(self.world_size)
        self.train_batch_size, self.train_micro_batch_size_per_gpu, self.gradient_accumulation_steps = sizes

    def _configure_train_batch_size(self) -> None:
        """Fill in the batch triad from the members set (DeepSpeed's method): a triad that does not fit
        the data-parallel size raises AssertionError, as there."""
        try:
            sizes = resolve_batch_sizes(self.train_batch_size, self.train_micro_batch_size_per_gpu,
                                        self.gradient_accumulation_steps, dp_world_size=self.world_size)
        except ConfigError as exc:
            raise AssertionError(str(exc)) from exc
        self.train_batch_size, self.train_micro_batch_size_per_gpu, self.gradient_accumulation_steps = sizes

    @classmethod
    def _of(cls, config, *, world_size: int, batch: tuple[int, int, int]) -> "DeepSpeedConfig":
        """The view of a config shardwise already validated (``engine._config``)."""
        view = cls.__new__(cls)
        view._config, view.world_size = config, world_size  # (_param_dict: made when read, below)
        view.train_batch_size, view.train_micro_batch_size_per_gpu, view.gradient_accumulation_steps = batch
        return view

    def __getattr__(self, name: str) -> Any:
        config = self.__dict__["_config"]
        if name == "_param_dict":
            return config.to_dict()
        if name == "zero_config":  # the block under DeepSpeed's class and field names
            from .zero.config import DeepSpeedZeroConfig
            return DeepSpeedZeroConfig._wrap(config.zero_optimization)
        if name in _FLAT:  # DeepSpeed's flat attribute of a key inside a block
            block, key = _FLAT[name]
            return getattr(getattr(config, block), key)
        return getattr(config, name)


# DeepSpeedConfig's attribute names for keys that sit inside a block
_FLAT = {name: ("data_types", name) for name in ("grad_accum_dtype", "param_dtype", "buffer_dtype",
                                                  "keep_in_fp32_modules")}
_FLAT.update(fp16_enabled=("fp16", "enabled"), bfloat16_enabled=("bf16", "enabled"),
             zero_optimization_stage=("zero_optimization", "stage"))


__all__ = ["DeepSpeedConfig", "get_gradient_clipping"]
