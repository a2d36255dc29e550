"""Megatron-style tensor-parallel layers.

A tensor-sharded parameter carries Megatron's attributes ``tensor_model_parallel=True``,
``partition_dim`` (the dimension cut into tensor-size equal pieces, rank ``r`` holding piece ``r``)
and ``partition_stride=1``. A parameter without them is replicated across the tensor ranks. The
engine (gradient-norm clipping), the checkpoints and AutoTP all read these attributes.

Weights are initialised whole, exactly as ``nn.Linear`` / ``nn.Embedding`` would be with the same
RNG state, and then cut: a model built with the same seed is the same model at every tensor size.

Unlike Megatron-LM (which returns ``(output, bias)``), the linear layers return one tensor, like
``nn.Linear``; with ``skip_bias_add=True`` they return ``(output, bias)``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from shardwise import comm
from shardwise.tensor_parallel import mappings as M
from shardwise.tensor_parallel.sharding import ShardSpec
from shardwise.topology import TENSOR_AXIS, tensor_parallel_group_and_size

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding",
           "set_tensor_model_parallel_attributes", "param_is_not_tensor_parallel_duplicate",
           "is_tensor_parallel"]


def set_tensor_model_parallel_attributes(tensor: torch.Tensor, is_parallel: bool, dim: int, stride: int = 1) -> None:
    """Mark ``tensor`` as cut along ``dim`` over the tensor ranks (Megatron's function)."""
    tensor.tensor_model_parallel = bool(is_parallel)
    tensor.partition_dim = int(dim)
    tensor.partition_stride = int(stride)


def is_tensor_parallel(param: torch.Tensor) -> bool:
    return bool(getattr(param, "tensor_model_parallel", False))


def param_is_not_tensor_parallel_duplicate(param: torch.Tensor, group=TENSOR_AXIS) -> bool:
    """True on every tensor rank for a sharded parameter, on tensor rank 0 only for a replicated one
    (count each element once, e.g. in a norm)."""
    group, size = tensor_parallel_group_and_size(group)
    return is_tensor_parallel(param) or size == 1 or comm.get_rank(group) == 0


def _tp(group):
    group, size = tensor_parallel_group_and_size(group)
    rank = comm.get_rank(group) if size > 1 else 0
    return group, size, rank


def _piece(full: torch.Tensor, dim: int, size: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s equal piece of ``full`` along ``dim`` (a new tensor; the size was checked by ``_divide``)."""
    return ShardSpec.even(full.shape[dim], size, dim).cut(full, rank)


def _divide(n: int, size: int, what: str) -> int:
    if n % size:
        raise ValueError(f"{what} ({n}) is not divisible by the tensor-parallel size ({size})")
    return n // size


def _linear_init_(weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """What ``nn.Linear.reset_parameters`` does, on the full tensors."""
    nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
    if bias is not None:
        fan_in = weight.shape[1]
        bound = 1 / math.sqrt(fan_in) if fan_in > 0 else 0
        nn.init.uniform_(bias, -bound, bound)


def _full_linear(output_size: int, input_size: int, bias: bool, init_method):
    """The whole (weight, bias) of the layer, initialised as ``nn.Linear`` would (or by ``init_method``,
    bias zero), so that every tensor size cuts its piece from the same tensors."""
    full_w = torch.empty(output_size, input_size)
    full_b = torch.empty(output_size) if bias else None
    if init_method is None:
        _linear_init_(full_w, full_b)
    else:
        init_method(full_w)
        if full_b is not None:
            full_b.zero_()
    return full_w, full_b


class ColumnParallelLinear(nn.Module):
    """``Y = X A + b`` with ``A`` cut along its output columns: rank ``r`` computes ``Y_r``.

    ``gather_output=True`` all-gathers ``Y`` (every rank gets the whole output); ``False`` leaves each
    rank its slice (feed it to a ``RowParallelLinear(input_is_parallel=True)``). With
    ``sequence_parallel=True`` the input arrives split along ``sequence_dim`` and is all-gathered."""

    def __init__(self, input_size: int, output_size: int, bias: bool = True, gather_output: bool = True,
                 init_method=None, stride: int = 1, keep_master_weight_for_test: bool = False,
                 skip_bias_add: bool = False, *, sequence_parallel: bool = False, sequence_dim: int = 0,
                 group=TENSOR_AXIS, dtype=None, device=None) -> None:
        super().__init__()
        if stride != 1:
            raise ValueError(f"ColumnParallelLinear: stride={stride} is not supported (only 1)")
        self.group, self.world_size, self.rank = _tp(group)
        self.input_size, self.output_size = input_size, output_size
        self.output_size_per_partition = _divide(output_size, self.world_size, "ColumnParallelLinear output_size")
        self.gather_output, self.skip_bias_add = gather_output, skip_bias_add
        self.sequence_parallel, self.sequence_dim = sequence_parallel, sequence_dim
        if sequence_parallel and gather_output:
            raise ValueError("ColumnParallelLinear: sequence_parallel=True needs gather_output=False")
        dtype = dtype or torch.get_default_dtype()
        full_w, full_b = _full_linear(output_size, input_size, bias, init_method)
        if keep_master_weight_for_test:
            self.master_weight = full_w.clone()
        self.weight = nn.Parameter(_piece(full_w, 0, self.world_size, self.rank).to(dtype=dtype, device=device))
        set_tensor_model_parallel_attributes(self.weight, True, 0)
        if bias:
            self.bias = nn.Parameter(_piece(full_b, 0, self.world_size, self.rank).to(dtype=dtype, device=device))
            set_tensor_model_parallel_attributes(self.bias, True, 0)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor):
        if self.sequence_parallel:
            x = M.gather_from_sequence_parallel_region(x, self.group, dim=self.sequence_dim)
        else:
            x = M.copy_to_tensor_model_parallel_region(x, self.group)
        bias = None if self.skip_bias_add else self.bias
        y = F.linear(x, self.weight, bias)
        if self.gather_output:
            y = M.gather_from_tensor_model_parallel_region(y, self.group)
        return (y, self.bias) if self.skip_bias_add else y

    def extra_repr(self) -> str:
        return (f"in={self.input_size}, out={self.output_size} (this rank {self.output_size_per_partition}), "
                f"gather_output={self.gather_output}")


class RowParallelLinear(nn.Module):
    """``Y = X A + b`` with ``A`` cut along its input rows: rank ``r`` computes ``X_r A_r`` and the
    partial products are summed (all-reduce; reduce-scatter along ``sequence_dim`` with
    ``sequence_parallel=True``). ``input_is_parallel=True``: ``X`` already arrives split along its last
    dimension (from a ``ColumnParallelLinear(gather_output=False)``). The bias is replicated."""

    def __init__(self, input_size: int, output_size: int, bias: bool = True, input_is_parallel: bool = False,
                 init_method=None, stride: int = 1, keep_master_weight_for_test: bool = False,
                 skip_bias_add: bool = False, *, sequence_parallel: bool = False, sequence_dim: int = 0,
                 group=TENSOR_AXIS, dtype=None, device=None) -> None:
        super().__init__()
        if stride != 1:
            raise ValueError(f"RowParallelLinear: stride={stride} is not supported (only 1)")
        self.group, self.world_size, self.rank = _tp(group)
        self.input_size, self.output_size = input_size, output_size
        self.input_size_per_partition = _divide(input_size, self.world_size, "RowParallelLinear input_size")
        self.input_is_parallel, self.skip_bias_add = input_is_parallel, skip_bias_add
        self.sequence_parallel, self.sequence_dim = sequence_parallel, sequence_dim
        if sequence_parallel and not input_is_parallel:
            raise ValueError("RowParallelLinear: sequence_parallel=True needs input_is_parallel=True")
        dtype = dtype or torch.get_default_dtype()
        full_w, full_b = _full_linear(output_size, input_size, bias, init_method)
        if keep_master_weight_for_test:
            self.master_weight = full_w.clone()
        self.weight = nn.Parameter(_piece(full_w, 1, self.world_size, self.rank).to(dtype=dtype, device=device))
        set_tensor_model_parallel_attributes(self.weight, True, 1)
        if bias:
            self.bias = nn.Parameter(full_b.to(dtype=dtype, device=device).clone())
            # Under sequence parallelism each rank adds the bias to its sequence shard only: its gradient
            # is a partial sum over the tensor ranks (the engine all-reduces such parameters).
            self.bias.sequence_parallel = sequence_parallel
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor):
        if not self.input_is_parallel:
            x = M.scatter_to_tensor_model_parallel_region(x, self.group)
        y = F.linear(x, self.weight)
        if self.sequence_parallel:
            y = M.reduce_scatter_to_sequence_parallel_region(y, self.group, dim=self.sequence_dim)
        else:
            y = M.reduce_from_tensor_model_parallel_region(y, self.group)
        if self.skip_bias_add:
            return y, self.bias
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (f"in={self.input_size} (this rank {self.input_size_per_partition}), out={self.output_size}, "
                f"input_is_parallel={self.input_is_parallel}")


class VocabParallelEmbedding(nn.Module):
    """``nn.Embedding`` with the vocabulary cut into tensor-size equal ranges: each rank looks up the ids
    in its range (zeros elsewhere) and the partial results are all-reduced."""

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: int | None = None,
                 init_method=None, *, group=TENSOR_AXIS, dtype=None, device=None) -> None:
        super().__init__()
        self.group, self.world_size, self.rank = _tp(group)
        self.num_embeddings, self.embedding_dim, self.padding_idx = num_embeddings, embedding_dim, padding_idx
        per = _divide(num_embeddings, self.world_size, "VocabParallelEmbedding num_embeddings (vocabulary size)")
        self.vocab_start_index, self.vocab_end_index = self.rank * per, (self.rank + 1) * per
        dtype = dtype or torch.get_default_dtype()
        full = torch.empty(num_embeddings, embedding_dim)
        (init_method or nn.init.normal_)(full)
        if padding_idx is not None:
            full[padding_idx].zero_()
        self.weight = nn.Parameter(_piece(full, 0, self.world_size, self.rank).to(dtype=dtype, device=device))
        set_tensor_model_parallel_attributes(self.weight, True, 0)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return F.embedding(ids, self.weight, self.padding_idx)
        outside = (ids < self.vocab_start_index) | (ids >= self.vocab_end_index)
        local = (ids - self.vocab_start_index).masked_fill(outside, 0)
        pad = None
        if self.padding_idx is not None and self.vocab_start_index <= self.padding_idx < self.vocab_end_index:
            pad = self.padding_idx - self.vocab_start_index
        out = F.embedding(local, self.weight, pad)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return M.reduce_from_tensor_model_parallel_region(out, self.group)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim} (this rank ids [{self.vocab_start_index}, " \
               f"{self.vocab_end_index}))"
