"""``deepspeed.module_inject.layers``: DeepSpeed's AutoTP layer classes and their universal-checkpoint metadata.

The layers subclass shardwise's (``shardwise.tensor_parallel.autotp_layers``), so a model built from them is
an AutoTP model to shardwise, and follow DeepSpeed's constructor: ``mp_group=None`` means no tensor
parallelism (the layer only records its layout); with a group the layer keeps this rank's piece. What a
layer holds is described by shardwise's one sharding spec (``shardwise.tensor_parallel.sharding.ShardSpec``:
sub-parameters and per-rank widths, from ``shard_widths``, which ``deepspeed.module_inject.tp_shard`` names),
and the spec cuts and gathers; the forward passes are shardwise's layers'. ``gather_params`` /
``_tp_partition`` (also set on the parameters, as DeepSpeed does) gather the whole tensor over the group and
cut it again. This module holds DeepSpeed's class names, constructors and metadata, no tensor math.

Every sharded parameter carries ``ds_autotp_universal_checkpoint_meta`` (restore-side fields plus a
``conversion`` view); ``collect_autotp_universal_checkpoint_info(model)`` turns those into DeepSpeed's
model-level ``universal_checkpoint_info`` (pattern lists by layout). The geometric ``affine_map`` DeepSpeed
0.19.8 adds beside the lists is not written (converters that predate it read the lists).

Not provided: the Yuan shared-QK split and codegen's fused QKV (``Yuan_*`` record their layout as
unsupported and refuse to materialise, ``fused_LinearLayer`` refuses to be built), uneven pieces under a
real group (shardwise's tensor-parallel checkpoints store equal pieces).
"""

from __future__ import annotations

import enum
import re
from typing import Any

import torch
from torch import nn

from deepspeed.checkpoint.constants import (AUTOTP_UNSUPPORTED_PARAMETER_PATTERNS, DS_AUTOTP_UC_META,
                                            ORIGINAL_VOCAB_SIZE, PARAMETER_WITH_ROW_PARALLELISM_PATTERNS,
                                            PARAMETER_WITH_SUB_PARAMS, SUB_PARAM_SHARD_WIDTHS,
                                            TP_REPLICATED_PARAMETER_PATTERNS, UNIVERSAL_CHECKPOINT_VERSION_KEY,
                                            UNIVERSAL_CHECKPOINT_VERSION_VALUE, VOCABULARY_PARAMETER_PATTERNS)
from deepspeed.module_inject.tp_shard import AutoTPMeta
from shardwise import comm
from shardwise.tensor_parallel import autotp_layers as _sw
from shardwise.tensor_parallel.sharding import ShardSpec, subparam_layout

__all__ = ["TensorParallel_Layer", "LinearAllreduce", "LinearLayer", "SubParamLinearLayer", "SubParamLinearAllreduce",
           "GateUpPack_LinearLayer", "Yuan_LinearLayer", "Yuan_LinearAllreduce", "fused_LinearLayer",
           "set_autotp_mode", "is_autotp_training_mode", "get_auto_tp_mode", "collect_autotp_universal_checkpoint_info"]

DS_IS_REPLACED_MODULE = "ds_is_replaced_module"
DS_TENSOR_MODEL_PARALLEL = "tensor_model_parallel"


class AUTOTP_MODE(enum.Enum):  # noqa: N801 (DeepSpeed's name)
    TRAINING = "TRAINING"
    INFERENCE = "INFERENCE"


_MODE = AUTOTP_MODE.INFERENCE


def get_auto_tp_mode() -> AUTOTP_MODE:
    return _MODE


def is_autotp_training_mode() -> bool:
    return _MODE is AUTOTP_MODE.TRAINING


def set_autotp_mode(training: bool = False) -> None:
    """DeepSpeed's process-wide AutoTP mode: layers built in inference mode freeze their weights
    (``requires_grad=False``), as DeepSpeed's do; ``initialize`` with ``tensor_parallel.autotp_size`` trains
    shardwise's own AutoTP layers whatever this says."""
    global _MODE
    _MODE = AUTOTP_MODE.TRAINING if training else AUTOTP_MODE.INFERENCE


# -- the per-parameter metadata ---------------------------------------------------------------------------------

def _normalize_uc_shape(value):
    return tuple(value) if value is not None else None


def _build_param_uc_conversion_meta(*, partition_type, partition_dim=None, sub_param_shape=None,
                                    sub_param_shard_widths=None, original_shape=None, is_bias=False,
                                    replicated=False, unsupported_reason=None) -> dict:
    """The fields a checkpoint converter needs (what ``collect_autotp_universal_checkpoint_info`` reads)."""
    return {"partition_type": partition_type, "partition_dim": partition_dim,
            "sub_param_shape": _normalize_uc_shape(sub_param_shape), "sub_param_shard_widths": sub_param_shard_widths,
            "original_shape": _normalize_uc_shape(original_shape), "is_bias": is_bias, "replicated": replicated,
            "unsupported_reason": unsupported_reason}


def _build_param_uc_restore_meta(*, partition_type, partition_dim=None, logical_shape=None, output_shape=None,
                                 sub_param_shape=None, sub_param_sizes=None, sub_param_shard_widths=None,
                                 partition_sizes=None, target_partition_shape=None, original_shape=None,
                                 is_bias=False, replicated=False, unsupported_reason=None) -> dict:
    """Everything a restore needs to cut this rank's piece, with the converter's view under ``conversion``."""
    shapes = {"logical_shape": logical_shape, "output_shape": output_shape, "sub_param_shape": sub_param_shape,
              "sub_param_sizes": sub_param_sizes}
    meta = {UNIVERSAL_CHECKPOINT_VERSION_KEY: UNIVERSAL_CHECKPOINT_VERSION_VALUE, "partition_type": partition_type,
            "partition_dim": partition_dim, **{k: _normalize_uc_shape(v) for k, v in shapes.items()},
            "sub_param_shard_widths": sub_param_shard_widths, "partition_sizes": _normalize_uc_shape(partition_sizes),
            "target_partition_shape": _normalize_uc_shape(target_partition_shape),
            "original_shape": _normalize_uc_shape(original_shape), "is_bias": is_bias, "replicated": replicated}
    meta["conversion"] = _build_param_uc_conversion_meta(
        partition_type=partition_type, partition_dim=partition_dim, sub_param_shape=sub_param_shape,
        sub_param_shard_widths=sub_param_shard_widths, original_shape=original_shape, is_bias=is_bias,
        replicated=replicated, unsupported_reason=unsupported_reason)
    return meta


def _get_param_uc_conversion_meta(param: torch.Tensor) -> dict | None:
    meta = getattr(param, DS_AUTOTP_UC_META, None)
    return meta.get("conversion") if meta else None


def _shardwise_layer_conversion(module: nn.Module, param: torch.Tensor) -> dict | None:
    """The converter's view of a parameter of shardwise's own AutoTP layers (what the engine's AutoTP builds), from
    the Megatron attributes they carry (``partition_dim``, ``partition_stride``): a column layer's weight and bias
    are cut along their outputs, a row layer's weight along its inputs and its bias is replicated; a fused weight
    (stride s) is s equal sub-parameters each cut over the ranks. GPT-2's ``Conv1D`` layout (``[in, out]``) is
    not one DeepSpeed's universal checkpoint describes: recorded as unsupported."""
    if not isinstance(module, _sw.TensorParallel_Layer) or isinstance(module, TensorParallel_Layer):
        return None
    is_bias = param is getattr(module, "bias", None)
    kind = "row" if isinstance(module, _sw.LinearAllreduce) else "column"
    if not getattr(param, "tensor_model_parallel", False):
        return _build_param_uc_conversion_meta(partition_type=kind,
                                               original_shape=tuple(getattr(param, "ds_shape", None) or param.shape),
                                               is_bias=is_bias, replicated=True)
    dim, stride, size = param.partition_dim, getattr(param, "partition_stride", 1), module.tp_world_size
    shape = list(getattr(param, "ds_shape", None) or param.shape)  # (a ZeRO-3 parameter's whole shape)
    shape[dim] *= size
    if module.conv1d_layout:
        return _build_param_uc_conversion_meta(
            partition_type=kind, partition_dim=dim, original_shape=tuple(shape), is_bias=is_bias,
            unsupported_reason="a Conv1D ([in, out]) weight, a layout DeepSpeed's universal checkpoint does not "
                               "describe")
    sub_shape = widths = None
    if stride > 1:
        part = shape[dim] // stride
        sub_shape = list(shape)
        sub_shape[dim] = (part, ) * stride
        widths = [[part // size] * size for _ in range(stride)]
    return _build_param_uc_conversion_meta(partition_type=kind, partition_dim=dim, sub_param_shape=sub_shape,
                                           sub_param_shard_widths=widths, original_shape=tuple(shape),
                                           is_bias=is_bias)


def collect_autotp_universal_checkpoint_info(model: nn.Module) -> dict[str, Any]:
    """DeepSpeed's ``universal_checkpoint_info`` of an AutoTP model: one regex per parameter (``^name$``), filed
    by layout, for the layers of this module and shardwise's own (``_shardwise_layer_conversion``). Parameters
    without metadata (norms, embeddings AutoTP left alone) are tensor-replicated; tied aliases are left out (the
    checkpoint knows a tensor under its first name only)."""
    row, replicated, vocabulary, sub_params, unsupported, widths = [], [], [], [], {}, {}
    vocab_size = None
    first_name = {}
    for name, param in model.named_parameters():
        first_name.setdefault(id(param), name)
    for module_name, module in model.named_modules():
        if isinstance(module, TensorParallel_Layer):
            module._mark_uc_metadata()
        for param_name, param in module.named_parameters(recurse=False):
            full = f"{module_name}.{param_name}" if module_name else param_name
            if first_name.get(id(param), full) != full:
                continue
            pattern = rf"^{re.escape(full)}$"
            conv = _get_param_uc_conversion_meta(param) or _shardwise_layer_conversion(module, param)
            if not conv:
                replicated.append(pattern)
                continue
            if conv.get("unsupported_reason"):
                unsupported[pattern] = conv["unsupported_reason"]
                continue
            if conv.get("replicated"):
                replicated.append(pattern)
            if conv.get("partition_type") == "row" and not conv.get("is_bias"):
                row.append(pattern)
            shape, dim = conv.get("original_shape"), conv.get("partition_dim")
            if shape and len(shape) == 2 and dim == 0 and ("embed" in full or "lm_head" in full):
                vocabulary.append(pattern)
                vocab_size = shape[0] if vocab_size is None else vocab_size
            spec = conv.get("sub_param_shape")
            if spec is not None and dim is not None:
                published = list(spec)
                if conv.get("sub_param_shard_widths") is not None:
                    # publish each sub-parameter's width, not a view spec's count such as the 3 of (3, -1)
                    published[dim] = tuple(sum(w) for w in conv["sub_param_shard_widths"])
                    widths[pattern] = [list(w) for w in conv["sub_param_shard_widths"]]
                sub_params.append({"patterns": [pattern], "shape": published, "partition_dim": dim})
    info = {UNIVERSAL_CHECKPOINT_VERSION_KEY: UNIVERSAL_CHECKPOINT_VERSION_VALUE,
            PARAMETER_WITH_ROW_PARALLELISM_PATTERNS: sorted(set(row)),
            TP_REPLICATED_PARAMETER_PATTERNS: sorted(set(replicated)),
            VOCABULARY_PARAMETER_PATTERNS: sorted(set(vocabulary)), PARAMETER_WITH_SUB_PARAMS: sub_params,
            AUTOTP_UNSUPPORTED_PARAMETER_PATTERNS: unsupported}
    if widths:
        info[SUB_PARAM_SHARD_WIDTHS] = widths
    if vocab_size is not None:
        info[ORIGINAL_VOCAB_SIZE] = vocab_size
    return info


# -- sub-parameter layouts (fused q/k/v, gate/up): shardwise.tensor_parallel.sharding ------------------------------

def _subparam_shard_widths(subparam_sizes, tp_world_size, meta=None, name=None) -> list:
    """DeepSpeed's per-rank width of each sub-parameter, one list per sub-parameter: the split of
    ``shardwise.tensor_parallel.sharding.ShardSpec`` (whole key/value heads where ``meta`` says so; a rank may
    hold none of a sub-parameter narrower than the tensor size)."""
    return [list(w) for w in ShardSpec.of(tuple(subparam_sizes), tp_world_size, 0, meta or AutoTPMeta(), name).widths]


def _prod(values) -> int:
    out = 1
    for v in values:
        out *= v
    return out


# -- the layers --------------------------------------------------------------------------------------------------

class TensorParallel_Layer(_sw.TensorParallel_Layer):  # noqa: N801 (DeepSpeed's name)
    """DeepSpeed's base: ``mp_group=None`` is tensor size 1 (metadata only); ``tp_meta`` the model's head counts."""

    keep_module_on_host: bool = False
    tp_overlap_comm: bool = False
    _unsupported_uc_reason: str | None = None

    def __init__(self, mp_group, **kwargs: Any) -> None:
        size = 1 if mp_group is None else comm.get_world_size(mp_group)
        rank = 0 if mp_group is None else comm.get_rank(mp_group)
        _sw.TensorParallel_Layer.__init__(self, mp_group, name=kwargs.get("name"), tp_size=size, tp_rank=rank)
        self.mp_group = mp_group
        self.conv1d_layout = False  # DeepSpeed's layers take an nn.Linear ([out, in] weight)
        self.support_training = True
        self.tp_meta = kwargs.get("tp_meta") or AutoTPMeta()

    @classmethod
    def set_keep_module_on_host(cls, value: bool) -> None:
        cls.keep_module_on_host = value

    def is_training_mode(self) -> bool:
        return is_autotp_training_mode()

    @staticmethod
    def _shape_before_zero3_partition(param) -> tuple:
        """A ZeRO-3 parameter's shape before partitioning emptied it (``ds_shape``), else its shape."""
        return tuple(getattr(param, "ds_shape", None) or param.shape)

    def _is_bias_param(self, param) -> bool:
        return getattr(self, "bias", None) is not None and param is self.bias

    def _freeze_partition_sizes(self, total_size: int) -> tuple:
        """The per-rank widths of this layer's split dimension, resolved once while it is built."""
        self._partition_sizes = tuple(ShardSpec.of((total_size, ), self.tp_world_size, 0, self.tp_meta,
                                                   self.name).widths[0])
        return self._partition_sizes

    def _spec(self, dim: int, sizes=None, widths=None) -> ShardSpec:
        """The layer's cut of dimension ``dim``: its sub-parameters ``sizes`` split at ``widths``, else the whole
        dimension split at ``_partition_sizes``."""
        if sizes is None:
            return ShardSpec(dim, (sum(self._partition_sizes), ), (tuple(self._partition_sizes), ))
        return ShardSpec(dim, tuple(sizes), tuple(tuple(w) for w in widths))

    def _cut(self, tensor, spec: ShardSpec):
        return spec.cut(tensor, self.tp_index) if self.tp_world_size > 1 else tensor

    def _whole(self, tensor, spec: ShardSpec):
        return spec.gather(tensor, self.mp_group) if self.mp_group is not None and self.tp_world_size > 1 else tensor

    def _set_param_uc_meta(self, param, **fields) -> None:
        if param is not None:
            setattr(param, DS_AUTOTP_UC_META, _build_param_uc_restore_meta(**fields))

    def _mark_uc_metadata(self) -> None:
        return None

    def config_requires_grad(self, param) -> None:
        if param is not None and not self.is_training_mode():
            param.requires_grad = False

    def config_tp_params(self, param, partition_dim: int | None = None, stride: int = 1) -> None:
        """Mark ``param`` as tensor-sharded (shardwise's and DeepSpeed's attributes) and bind the layer's
        gather/partition to it, as DeepSpeed does."""
        if param is None:
            return
        self.config_requires_grad(param)
        param.gather_params = self.gather_params
        param._tp_partition = self._tp_partition
        setattr(param, DS_IS_REPLACED_MODULE, True)
        if partition_dim is not None:
            _sw.mark_tensor_parallel(param, partition_dim, stride)

    def _check_sub_param_split(self, sizes, widths, dim_ok: bool) -> int:
        """Under a real group, the sub-parameter split must be one shardwise's tensor-parallel checkpoints can
        describe (Megatron's strided layout: equal sub-parameters, each cut evenly); returns the stride."""
        if self.mp_group is None or self.tp_world_size == 1:
            return len(sizes)
        if not dim_ok or len(set(sizes)) != 1 or any(min(w) != max(w) for w in widths):
            raise ValueError(f"AutoTP layer '{self.name}': sub-parameters {list(sizes)} cut {list(map(list, widths))} "
                             "over the tensor ranks; shardwise's tensor-parallel checkpoints describe only equal "
                             "sub-parameters, each split evenly along the weight's output (column) or input (row) "
                             "features")
        return len(sizes)

    def _materialize(self, params, cut) -> None:
        """Keep this rank's piece (only under a real group, as DeepSpeed); ``cut(param)`` returns it."""
        if self.mp_group is None:
            return
        sizes = getattr(self, "_partition_sizes", None)
        if sizes and min(sizes) != max(sizes) and not isinstance(self, _SubParamColumn):
            raise ValueError(f"AutoTP layer '{self.name}': its split {sizes} is uneven; shardwise's tensor-parallel "
                             "checkpoints store equal pieces, so it cannot train this layer (pick a tensor size "
                             "that divides the dimension)")
        with torch.no_grad():
            for p in params:
                if p is not None:
                    p.data = self.move(cut(p))

    def move(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.detach().contiguous().clone()

    def _gather(self, param, dim: int) -> None:
        if self.mp_group is not None and self.tp_world_size > 1:
            with torch.no_grad():
                param.data = self._whole(param.data, self._spec(dim))

    def extra_repr(self) -> str:
        return f"name={self.name}, tp={self.tp_index}/{self.tp_world_size}, weight={tuple(self.weight.shape)}"


class LinearAllreduce(TensorParallel_Layer, _sw.LinearAllreduce):
    """Row-parallel: the input features are split, the output all-reduced; the bias is replicated."""

    def __init__(self, module: nn.Module, mp_group, **kwargs) -> None:
        TensorParallel_Layer.__init__(self, mp_group, **kwargs)
        self.weight, self.bias = module.weight, module.bias
        self._orig_weight_shape = self._shape_before_zero3_partition(module.weight)
        self._freeze_partition_sizes(self._orig_weight_shape[1])
        self.in_features, self.out_features = self._orig_weight_shape[1], self._orig_weight_shape[0]
        self._tp_partition([self.weight, self.bias])
        self.config_tp_params(self.weight, partition_dim=1)
        self.config_requires_grad(self.bias)
        self._mark_uc_metadata()

    def gather_params(self, params_list) -> None:
        if params_list and params_list[0] is not None:
            self._gather(params_list[0], 1)

    def _tp_partition(self, params_list) -> None:
        self._materialize(params_list[:1], lambda p: self._cut(p.data, self._spec(1)))

    def _mark_uc_metadata(self) -> None:
        shape = self._orig_weight_shape
        self._set_param_uc_meta(self.weight, partition_type="row", partition_dim=1, logical_shape=shape,
                                output_shape=(shape[0], ), partition_sizes=self._partition_sizes,
                                target_partition_shape=tuple(self.weight.shape), original_shape=shape,
                                unsupported_reason=self._unsupported_uc_reason)
        if self.bias is not None:
            bias_shape = self._shape_before_zero3_partition(self.bias)
            self._set_param_uc_meta(self.bias, partition_type="row", logical_shape=bias_shape,
                                    output_shape=bias_shape, original_shape=bias_shape, is_bias=True,
                                    replicated=self._unsupported_uc_reason is None,
                                    unsupported_reason=self._unsupported_uc_reason)


class LinearLayer(TensorParallel_Layer, _sw.LinearLayer):
    """Column-parallel: the output features (weight and bias) are split; ``gather_output`` all-gathers them."""

    def __init__(self, module: nn.Module, mp_group=None, skip_partition: bool = False, gather_output: bool = False,
                 **kwargs) -> None:
        TensorParallel_Layer.__init__(self, mp_group, **kwargs)
        self.weight, self.bias = module.weight, module.bias
        self.gather_output = gather_output
        self.fused_parts = 1
        self._orig_weight_shape = self._shape_before_zero3_partition(module.weight)
        self._orig_bias_shape = self._shape_before_zero3_partition(module.bias) if self.bias is not None else None
        self.in_features, self.out_features = self._orig_weight_shape[1], self._orig_weight_shape[0]
        self._freeze_partition_sizes(self._orig_weight_shape[0])
        if not skip_partition:
            self._tp_partition([self.weight, self.bias])
        self.config_tp_params(self.weight, partition_dim=0)
        self.config_tp_params(self.bias, partition_dim=0)
        self._mark_uc_metadata()

    def gather_params(self, params_list) -> None:
        for p in params_list:
            if p is not None:
                self._gather(p, 0)

    def _tp_partition(self, params_list) -> None:
        self._materialize(params_list, lambda p: self._cut(p.data, self._spec(0)))

    def _mark_uc_metadata(self) -> None:
        shape, reason = self._orig_weight_shape, self._unsupported_uc_reason
        self._set_param_uc_meta(self.weight, partition_type="column", partition_dim=0, logical_shape=shape,
                                output_shape=(shape[0], ), partition_sizes=self._partition_sizes,
                                target_partition_shape=tuple(self.weight.shape), original_shape=shape,
                                unsupported_reason=reason)
        if self.bias is not None:
            self._set_param_uc_meta(self.bias, partition_type="column", partition_dim=0,
                                    logical_shape=self._orig_bias_shape, output_shape=self._orig_bias_shape,
                                    partition_sizes=self._partition_sizes,
                                    target_partition_shape=tuple(self.bias.shape), original_shape=self._orig_bias_shape,
                                    is_bias=True, unsupported_reason=reason)


class _SubParamColumn(LinearLayer):
    """A column-parallel weight made of sub-parameters stacked along its outputs (``_subparam_sizes``), each
    cut over the ranks separately, so a rank's piece holds a slice of every one."""

    def _freeze_partition_sizes(self, total_size: int) -> tuple:
        sizes = super()._freeze_partition_sizes(total_size)
        self._subparam_shard_widths = [list(w) for w in ShardSpec.of(self._subparam_sizes, self.tp_world_size, 0,
                                                                     self.tp_meta, self._subparam_shard_name).widths]
        self._stride = self._check_sub_param_split(self._subparam_sizes, self._subparam_shard_widths, True)
        return sizes

    def config_tp_params(self, param, partition_dim: int | None = None, stride: int = 1) -> None:
        super().config_tp_params(param, partition_dim, self._stride)

    def _tp_partition(self, params_list) -> None:
        spec = self._spec(0, self._subparam_sizes, self._subparam_shard_widths)
        self._materialize(params_list, lambda p: self._cut(p.data, spec))

    def gather_params(self, params_list) -> None:
        for p in params_list:
            if p is not None:
                shape = self._orig_bias_shape if self._is_bias_param(p) else self._orig_weight_shape
                spec = self._spec(0, self._subparam_sizes, self._subparam_shard_widths)
                p.data = self._whole(p.data, spec).contiguous()

    def _mark_uc_metadata(self) -> None:
        for param, shape, is_bias in ((self.weight, self._orig_weight_shape, False),
                                      (self.bias, self._orig_bias_shape, True)):
            if param is not None:
                self._set_param_uc_meta(param, partition_type="column", partition_dim=0, logical_shape=shape,
                                        output_shape=(shape[0], ), sub_param_shape=(self._subparam_sizes, *shape[1:]),
                                        sub_param_sizes=self._subparam_sizes,
                                        sub_param_shard_widths=self._subparam_shard_widths,
                                        target_partition_shape=tuple(param.shape), original_shape=shape,
                                        is_bias=is_bias)


class GateUpPack_LinearLayer(_SubParamColumn):  # noqa: N801 (DeepSpeed's name)
    """ChatGLM2's packed ``[gate; up]`` projection: the two halves are cut separately."""

    def __init__(self, module: nn.Module, mp_group=None, **kwargs) -> None:
        half = self._shape_before_zero3_partition(module.weight)[0] // 2
        self._subparam_sizes, self._subparam_shard_name = (half, half), "mlp"
        super().__init__(module, mp_group, **kwargs)


class _SubParamMixin:
    """Shared by ``SubParamLinearLayer`` (column) and ``SubParamLinearAllreduce`` (row): the weight viewed as
    ``shape`` with sub-parameters along ``partition_dim``, each cut over the ranks."""

    def _init_layout(self, module, shape, partition_dim) -> None:
        self.weight, self.bias = module.weight, module.bias
        self.shape, self.partition_dim = shape, partition_dim
        self._orig_weight_shape = tuple(module.weight.shape)
        self._orig_bias_shape = tuple(module.bias.shape) if self.bias is not None else None
        (self._logical_shape, self._output_shape, self._subparam_sizes,
         self._bias_partition_dim) = subparam_layout(self._orig_weight_shape, shape, partition_dim, self.name)
        self._subparam_shard_widths = [list(w) for w in ShardSpec.of(
            self._subparam_sizes or (self._logical_shape[partition_dim], ), self.tp_world_size, partition_dim,
            self.tp_meta, self.name).widths]
        last = len(self._logical_shape) - 1
        dim_ok = partition_dim == 0 if isinstance(self, SubParamLinearLayer) else partition_dim == last
        self._stride = self._check_sub_param_split(self._subparam_sizes or (self._logical_shape[partition_dim], ),
                                                   self._subparam_shard_widths, dim_ok)
        if self.bias is not None and self.bias.numel() != _prod(self._output_shape):
            raise ValueError(f"AutoTP layer '{self.name}': bias of {self.bias.numel()} elements does not match the "
                             f"output shape {self._output_shape}")
        self.in_features, self.out_features = self._orig_weight_shape[1], self._orig_weight_shape[0]

    def _layout_spec(self, dim: int) -> ShardSpec:
        return self._spec(dim, self._subparam_sizes or (self._logical_shape[self.partition_dim], ),
                          self._subparam_shard_widths)

    def _cut_layout(self, tensor, logical_shape, dim: int):
        """This rank's piece of ``tensor`` viewed as ``logical_shape``, cut along ``dim``."""
        return self._cut(tensor.reshape(logical_shape), self._layout_spec(dim))

    def _gather_layout(self, tensor, logical_shape, dim: int):
        """The whole tensor of ``logical_shape`` from every rank's piece (cut along ``dim``)."""
        if self.mp_group is None or self.tp_world_size == 1:
            return tensor.reshape(logical_shape)
        spec = self._layout_spec(dim)
        shape = list(logical_shape)
        shape[dim] = sum(spec.local(self.tp_index))
        return self._whole(tensor.reshape(shape), spec)

    def _cut_weight(self, p):
        piece = self._cut_layout(p.data, self._logical_shape, self.partition_dim)
        return piece.reshape(_prod(piece.shape[:-1]), piece.shape[-1])

    def _gather_weight(self, p) -> None:
        full = self._gather_layout(p.data, self._logical_shape, self.partition_dim)
        p.data = full.reshape(self._orig_weight_shape).contiguous()

    def _materialize_subparams(self, params_list, cut_bias) -> None:
        """As ``_materialize``; a rank's pieces may be uneven (or empty) here: their widths are recorded."""
        if self.mp_group is None and self.tp_world_size == 1:
            return
        with torch.no_grad():
            for p in params_list:
                if p is None:
                    continue
                p.data = self.move(cut_bias(p) if self._is_bias_param(p) else self._cut_weight(p))


class SubParamLinearLayer(_SubParamMixin, TensorParallel_Layer, _sw.LinearLayer):
    """Column-parallel with sub-parameters: ``shape=(3, -1)`` is three equal ones (fused q/k/v),
    ``((q, k, v), -1)`` three of the given sizes (grouped-query attention)."""

    def __init__(self, module: nn.Module, mp_group, shape, partition_dim: int = 0, **kwargs) -> None:
        TensorParallel_Layer.__init__(self, mp_group, **kwargs)
        self.gather_output, self.fused_parts = False, 1
        self._init_layout(module, shape, partition_dim)
        spec = None
        if self._bias_partition_dim is not None:
            spec = list(self._output_shape)
            if self._subparam_sizes is not None:
                spec[self._bias_partition_dim] = tuple(self._subparam_sizes)
            spec = tuple(spec)
        self._bias_shape_spec = spec
        if self.mp_group is not None:
            self._tp_partition([self.weight, self.bias])
        self.config_tp_params(self.weight, partition_dim=0, stride=self._stride)
        self.config_tp_params(self.bias, partition_dim=None if self._bias_partition_dim is None else 0,
                              stride=self._stride)
        self._mark_uc_metadata()

    def _cut_bias(self, p):
        if self._bias_partition_dim is None:
            return p.data
        piece = self._cut_layout(p.data, self._output_shape, self._bias_partition_dim)
        return piece.reshape(-1)

    def _tp_partition(self, params_list) -> None:
        self._materialize_subparams(params_list, self._cut_bias)

    def gather_params(self, params_list) -> None:
        for p in params_list:
            if p is None:
                continue
            if not self._is_bias_param(p):
                self._gather_weight(p)
            elif self._bias_partition_dim is not None:
                full = self._gather_layout(p.data, self._output_shape, self._bias_partition_dim)
                p.data = full.reshape(self._orig_bias_shape).contiguous()

    def _mark_uc_metadata(self) -> None:
        self._set_param_uc_meta(self.weight, partition_type="column", partition_dim=self.partition_dim,
                                logical_shape=self._logical_shape, output_shape=self._output_shape,
                                sub_param_shape=self.shape, sub_param_sizes=self._subparam_sizes,
                                sub_param_shard_widths=self._subparam_shard_widths,
                                target_partition_shape=self.weight.shape, original_shape=self._orig_weight_shape)
        if self.bias is not None:
            split = self._bias_partition_dim is not None
            self._set_param_uc_meta(self.bias, partition_type="column", partition_dim=self._bias_partition_dim,
                                    logical_shape=self._output_shape, output_shape=self._output_shape,
                                    sub_param_shape=self._bias_shape_spec,
                                    sub_param_sizes=self._subparam_sizes if split else None,
                                    sub_param_shard_widths=self._subparam_shard_widths if split else None,
                                    target_partition_shape=self.bias.shape, original_shape=self._orig_bias_shape,
                                    is_bias=True, replicated=not split)


class SubParamLinearAllreduce(_SubParamMixin, TensorParallel_Layer, _sw.LinearAllreduce):
    """Row-parallel with sub-parameters along the input features; the bias is replicated."""

    def __init__(self, module: nn.Module, mp_group, shape, partition_dim: int = 1, **kwargs) -> None:
        TensorParallel_Layer.__init__(self, mp_group, **kwargs)
        self._init_layout(module, shape, partition_dim)
        if self.mp_group is not None:
            self._tp_partition([self.weight, self.bias])
        self.config_tp_params(self.weight, partition_dim=1, stride=self._stride)
        self.config_requires_grad(self.bias)
        self._mark_uc_metadata()

    def _tp_partition(self, params_list) -> None:
        self._materialize_subparams(params_list, lambda p: p.data)

    def gather_params(self, params_list) -> None:
        for p in params_list:
            if p is not None and not self._is_bias_param(p):
                self._gather_weight(p)

    def _mark_uc_metadata(self) -> None:
        self._set_param_uc_meta(self.weight, partition_type="row", partition_dim=self.partition_dim,
                                logical_shape=self._logical_shape, output_shape=self._output_shape,
                                sub_param_shape=self.shape, sub_param_sizes=self._subparam_sizes,
                                sub_param_shard_widths=self._subparam_shard_widths,
                                target_partition_shape=self.weight.shape, original_shape=self._orig_weight_shape)
        if self.bias is not None:
            self._set_param_uc_meta(self.bias, partition_type="row", logical_shape=self._orig_bias_shape,
                                    output_shape=self._orig_bias_shape, original_shape=self._orig_bias_shape,
                                    target_partition_shape=self.bias.shape, is_bias=True, replicated=True)


_YUAN_REASON = ("Yuan shared-QK tensor parallelism selects noncontiguous head groups that universal checkpoint "
                "conversion cannot currently describe")


class _Unsplittable:
    """A layout shardwise cannot cut: built without a group it records why (universal-checkpoint metadata);
    with a group, or asked to gather, it refuses."""

    def _tp_partition(self, params_list) -> None:
        if self.mp_group is not None:
            raise NotImplementedError(f"AutoTP layer '{self.name}' ({type(self).__name__}): "
                                      f"{self._unsupported_uc_reason}; shardwise does not implement this split")

    def gather_params(self, params_list) -> None:
        raise RuntimeError(self._unsupported_uc_reason)


class Yuan_LinearLayer(_Unsplittable, LinearLayer):  # noqa: N801 (DeepSpeed's name)
    _unsupported_uc_reason = _YUAN_REASON


class Yuan_LinearAllreduce(_Unsplittable, LinearAllreduce):  # noqa: N801 (DeepSpeed's name)
    _unsupported_uc_reason = _YUAN_REASON


class fused_LinearLayer(LinearLayer):  # noqa: N801 (DeepSpeed's name)
    """Name only: DeepSpeed's split of codegen/bigcode fused QKV weights is not implemented."""

    def __init__(self, module, mp_group=None, skip_partition=False, **kwargs) -> None:
        raise NotImplementedError("deepspeed.module_inject.layers.fused_LinearLayer (codegen/bigcode fused QKV split) "
                                  "is not implemented by shardwise")
