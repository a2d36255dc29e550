"""``deepspeed.runtime.engine``: shardwise's engine module, with ``DeepSpeedEngine`` a subclass of
``shardwise.runtime.engine.Engine`` that adds DeepSpeed's private engine helpers, which DeepSpeed's tests
and some scripts call by name (``deepspeed.initialize`` builds it; shardwise's own classes stay as they are):

* ``engine._config``: DeepSpeed's flat config object (``deepspeed.runtime.config.DeepSpeedConfig``, a view of
  ``engine.config``), and ``gradient_clipping()`` read through it, as DeepSpeed's is;
* ``_mixed_precision_dtypes()``, ``_assert_valid_mixed_precision_config()``,
  ``_cast_module_mixed_precision(...)``: the ``data_types`` rules of ``shardwise.runtime.module_dtypes``;
* ``no_sync()`` refusing re-entry (AssertionError), as DeepSpeed's does (shardwise's ``Engine.no_sync`` nests).
"""
from __future__ import annotations

import contextlib

import torch

import shardwise.runtime.engine as _engine
from shardwise.config.base import _normalise_dtype
from shardwise.config.precision import param_dtype_conflict
from shardwise.precision import DTYPES
from shardwise.runtime.engine import Engine
from shardwise.runtime.module_dtypes import cast_buffers, cast_parameters

from deepspeed.compile._engine import DeepCompileEngineState

from .config import DeepSpeedConfig


def __getattr__(name: str):
    return getattr(_engine, name)


def _checkpoint_parallel_metadata(mpu) -> dict:
    """The ``checkpoint_parallel_dimensions`` entry DeepSpeed writes into each model-state file: the pipeline
    and tensor degrees read from ``mpu`` (1 each without one), from which ``deepspeed.checkpoint`` reads a
    checkpoint's layout."""
    from deepspeed.checkpoint.constants import CHECKPOINT_PARALLEL_DIMS, CHECKPOINT_PP_DEGREE, CHECKPOINT_TP_DEGREE
    from deepspeed.utils.bwc import bwc_pipeline_parallel_world_size, bwc_tensor_model_parallel_world_size

    return {CHECKPOINT_PARALLEL_DIMS: {CHECKPOINT_PP_DEGREE: bwc_pipeline_parallel_world_size(mpu),
                                       CHECKPOINT_TP_DEGREE: bwc_tensor_model_parallel_world_size(mpu)}}


def _torch_dtype(name) -> torch.dtype:
    return DTYPES[_normalise_dtype(name)]


class _DeepSpeedInternals(DeepCompileEngineState):
    """DeepSpeed's private engine methods. They read only ``_config``, ``module`` and the
    ``fp16_enabled``/``bfloat16_enabled`` accessors, as DeepSpeed's do."""

    @property
    def _config(self) -> DeepSpeedConfig:
        return DeepSpeedConfig._of(self.config, world_size=self.dp_world_size,
                                   batch=(self.train_batch_size(), self.train_micro_batch_size_per_gpu(),
                                          self.gradient_accumulation_steps()))

    def gradient_clipping(self) -> float:
        return self._config.gradient_clipping

    def _assert_valid_mixed_precision_config(self) -> None:
        """``data_types.param_dtype`` must agree with fp16/bf16 (AssertionError, as DeepSpeed; the engine
        refuses the config earlier with a ConfigError)."""
        name = self._config.param_dtype
        conflict = param_dtype_conflict(None if name is None else _normalise_dtype(name),
                                        fp16=self.fp16_enabled(), bf16=self.bfloat16_enabled())
        assert conflict is None, conflict

    def _mixed_precision_dtypes(self) -> tuple[torch.dtype | None, torch.dtype | None]:
        """(parameter dtype: fp16/bf16 or None, buffer dtype: ``data_types.buffer_dtype`` or None)."""
        param = torch.half if self.fp16_enabled() else torch.bfloat16 if self.bfloat16_enabled() else None
        name = self._config.buffer_dtype
        return param, None if name is None else _torch_dtype(name)

    def _cast_module_mixed_precision(self, param_dtype, buffer_dtype, is_zero_init_model, keep_pattern=None) -> None:
        """Parameters to ``param_dtype`` (not ``zero.Init``'s, already in theirs), buffers to ``buffer_dtype``
        only when it is set; buffers ``keep_pattern`` matches to fp32."""
        if param_dtype is not None and not is_zero_init_model:
            cast_parameters(self.module.parameters(), param_dtype)
        cast_buffers(self.module, buffer_dtype, keep_fp32=keep_pattern)


class DeepSpeedEngine(_DeepSpeedInternals, Engine):
    """What ``deepspeed.initialize`` returns for a model that is not a ``PipelineModule``: shardwise's
    ``Engine`` with DeepSpeed's private helpers. Under ZeRO-3 each module's ``_parameters`` is DeepSpeed's
    ``ZeROOrderedDict`` (``deepspeed.runtime.zero.parameter_offload``), modules attached after ``initialize``
    included (converted before the next forward). As DeepSpeed's ZeRO-3 partitions the model through
    ``zero.Init``, a ZeRO-3 engine installs the memory-efficient linear as ``torch.nn.functional.linear`` unless
    ``zero_optimization.memory_efficient_linear`` is false (``partition_parameters._use_mem_efficient_linear``).
    After AutoTP (``tensor_parallel.autotp_size`` > 1) the model carries DeepSpeed's ``universal_checkpoint_info``
    (``deepspeed.module_inject.layers.collect_autotp_universal_checkpoint_info``), as DeepSpeed's engine attaches it."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.config.tensor_parallel.autotp_size > 1 and getattr(self.module, "ds_autotp_parsed", False):
            from deepspeed.checkpoint.constants import UNIVERSAL_CHECKPOINT_INFO
            from deepspeed.module_inject.layers import collect_autotp_universal_checkpoint_info
            setattr(self.module, UNIVERSAL_CHECKPOINT_INFO, collect_autotp_universal_checkpoint_info(self.module))
        if self.zero_optimization_stage() == 3:
            from deepspeed.runtime.zero.parameter_offload import _zero3_module_prologue
            from deepspeed.runtime.zero.partition_parameters import _add_methods_to_tree, _use_mem_efficient_linear
            _zero3_module_prologue(self.module)
            _add_methods_to_tree(self.module)  # param.all_gather() / partition() ..., as DeepSpeed's parameters have
            if self.config.zero_optimization.memory_efficient_linear:
                _use_mem_efficient_linear()

    def forward(self, *args, **kwargs):
        if self.zero_optimization_stage() == 3:
            from deepspeed.runtime.zero.parameter_offload import _zero3_module_prologue
            _zero3_module_prologue(self.module)
        return super().forward(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """``Engine.no_sync`` once at a time: DeepSpeed keeps one ``inside_no_sync_ctxt`` flag and refuses a
        nested ``no_sync`` with an AssertionError."""
        assert not self.train_step.no_sync_depth, "no_sync context manager reentry is unsupported"
        with super().no_sync():
            yield
