"""The layers AutoTP puts in place of a Hugging Face model's projections.

``LinearLayer`` is column-parallel: it keeps this rank's slice of the output features, takes the
full (replicated) input and all-reduces the input's gradient over the tensor group.
``LinearAllreduce`` is row-parallel: it keeps this rank's slice of the input features, takes the
matching slice of the activation and all-reduces its output; its bias is replicated and added once,
after the reduction. The names and the module/``mp_group`` constructor follow DeepSpeed's
``deepspeed.module_inject.layers``.

Both accept an ``nn.Linear`` (weight ``[out, in]``) or a Hugging Face ``Conv1D`` (GPT-2; weight
``[in, out]``) and keep that layout, so a state dict of the sharded model has the original names and
the original orientation, sliced. Sharded parameters carry Megatron's attributes
``tensor_model_parallel``, ``partition_dim`` (in the parameter's own layout) and ``partition_stride``
(``> 1`` for a fused projection such as GPT-2's ``c_attn``, whose q, k and v are sliced separately:
rank ``r`` holds chunks ``r, r + tp, r + 2 tp`` of the ``3 tp`` equal chunks of the full dimension).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from shardwise import comm
from shardwise.tensor_parallel.mappings import (copy_to_tensor_model_parallel_region,
                                                gather_from_tensor_model_parallel_region,
                                                reduce_from_tensor_model_parallel_region)
from shardwise.tensor_parallel.sharding import ShardSpec

__all__ = ["TensorParallel_Layer", "LinearLayer", "LinearAllreduce", "is_conv1d", "mark_tensor_parallel"]


def is_conv1d(module: nn.Module) -> bool:
    """Hugging Face's ``Conv1D`` (GPT-2 family): a linear layer with a transposed ``[in, out]`` weight."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf") and module.weight.dim() == 2


def mark_tensor_parallel(param: nn.Parameter, partition_dim: int, partition_stride: int = 1) -> None:
    """Megatron's marking of a tensor-sharded parameter (unmarked parameters are replicated)."""
    param.tensor_model_parallel = True
    param.partition_dim = partition_dim
    param.partition_stride = partition_stride


def _shard(tensor: torch.Tensor, dim: int, rank: int, size: int, parts: int, what: str) -> torch.Tensor:
    """This rank's slice of ``tensor`` along ``dim``; with ``parts > 1`` the dimension is ``parts`` equal
    fused blocks (q, k, v) and the rank takes its slice of each."""
    return ShardSpec.even(tensor.shape[dim], size, dim, parts, what).cut(tensor, rank)


def _whole(piece: torch.Tensor, dim: int, stride: int, group, size: int) -> torch.Tensor:
    """The whole tensor from every rank's ``piece`` (inverse of ``_shard``): with ``stride`` > 1 each piece
    holds one slice of every fused block."""
    return ShardSpec.even(piece.shape[dim] * size, size, dim, stride).gather(piece, group)


class TensorParallel_Layer(nn.Module):  # noqa: N801 (DeepSpeed's name)
    """Common state of the AutoTP layers: the tensor group, this rank's index and the layout.

    ``gather_params(params)`` replaces each sharded parameter of the layer in ``params`` by the whole tensor
    (all-gathered over the tensor group, in place: the Parameter object stays), ``_tp_partition(params)``
    cuts this rank's piece again; both are also set on the sharded parameters, as DeepSpeed does.
    """

    def __init__(self, mp_group, *, name: str | None = None, tp_size: int | None = None,
                 tp_rank: int | None = None) -> None:
        super().__init__()
        # None is the whole world here (DeepSpeed's meaning), not "the active grid" as in mappings.py
        self.mp_group = mp_group if mp_group is not None or not comm.is_initialized() else comm.get_world_group()
        self.tp_world_size = tp_size if tp_size is not None else comm.get_world_size(mp_group)
        self.tp_index = tp_rank if tp_rank is not None else comm.get_rank(mp_group)
        self.world_size, self.rank = self.tp_world_size, self.tp_index  # DeepSpeed's older names
        self.name = name

    @staticmethod
    def _new_param(source: nn.Parameter, data: torch.Tensor) -> nn.Parameter:
        """The same Parameter object holding the slice (as DeepSpeed does), so an optimizer built on
        the model before sharding still points at the live parameters."""
        source.data = data
        return source

    def _bind(self, *params) -> None:
        for p in params:
            if p is not None and getattr(p, "tensor_model_parallel", False):
                p.gather_params, p._tp_partition = self.gather_params, self._tp_partition

    @torch.no_grad()
    def gather_params(self, params_list) -> None:
        for p in params_list:
            if p is not None and getattr(p, "tensor_model_parallel", False) and self.tp_world_size > 1 \
                    and p.shape[p.partition_dim] != self._full_dim:
                p.data = _whole(p.data, p.partition_dim, p.partition_stride, self.mp_group, self.tp_world_size)

    @torch.no_grad()
    def _tp_partition(self, params_list) -> None:
        for p in params_list:
            if p is not None and getattr(p, "tensor_model_parallel", False) and self.tp_world_size > 1 \
                    and p.shape[p.partition_dim] == self._full_dim:
                p.data = _shard(p.data, p.partition_dim, self.tp_index, self.tp_world_size, p.partition_stride,
                                f"'{self.name}'")

    def extra_repr(self) -> str:
        return (f"name={self.name}, tp={self.tp_index}/{self.tp_world_size}, "
                f"weight={tuple(self.weight.shape)}, conv1d_layout={self.conv1d_layout}")


class LinearLayer(TensorParallel_Layer):
    """Column-parallel replacement of ``module``: output features split over the tensor group.

    ``fused_parts`` > 1 treats the output as that many equal fused blocks (GPT-2's ``c_attn``: 3) and
    keeps this rank's slice of each, so q, k and v stay aligned head by head. ``gather_output``
    all-gathers the output features after the layer (each rank then holds the whole output).
    """

    gather_output: bool = False

    def __init__(self, module: nn.Module, mp_group=None, *, name: str | None = None, fused_parts: int = 1,
                 tp_size: int | None = None, tp_rank: int | None = None, gather_output: bool = False) -> None:
        super().__init__(mp_group, name=name, tp_size=tp_size, tp_rank=tp_rank)
        self.conv1d_layout = is_conv1d(module)
        self.fused_parts = fused_parts
        self.gather_output = gather_output
        out_dim = 1 if self.conv1d_layout else 0
        what = f"'{name}' ({type(module).__name__} weight {tuple(module.weight.shape)})"
        self.weight = self._new_param(module.weight, _shard(module.weight.detach(), out_dim, self.tp_index,
                                                             self.tp_world_size, fused_parts, what))
        mark_tensor_parallel(self.weight, out_dim, fused_parts)
        if module.bias is not None:
            self.bias = self._new_param(module.bias, _shard(module.bias.detach(), 0, self.tp_index,
                                                             self.tp_world_size, fused_parts, what))
            mark_tensor_parallel(self.bias, 0, fused_parts)
        else:
            self.register_parameter("bias", None)
        self.in_features = module.weight.shape[0 if self.conv1d_layout else 1]
        self.out_features = self.weight.shape[out_dim]
        self._full_dim = self.weight.shape[out_dim] * self.tp_world_size
        self._bind(self.weight, self.bias)

    def forward(self, input):  # noqa: A002
        if self.tp_world_size > 1:
            input = copy_to_tensor_model_parallel_region(input, self.mp_group)
        if self.conv1d_layout:
            out = input @ self.weight
            out = out + self.bias if self.bias is not None else out
        else:
            out = F.linear(input, self.weight, self.bias)
        if self.gather_output and self.tp_world_size > 1:
            out = gather_from_tensor_model_parallel_region(out, self.mp_group)
        return out


class LinearAllreduce(TensorParallel_Layer):
    """Row-parallel replacement of ``module``: input features split, output all-reduced, bias replicated."""

    def __init__(self, module: nn.Module, mp_group=None, *, name: str | None = None,
                 tp_size: int | None = None, tp_rank: int | None = None) -> None:
        super().__init__(mp_group, name=name, tp_size=tp_size, tp_rank=tp_rank)
        self.conv1d_layout = is_conv1d(module)
        in_dim = 0 if self.conv1d_layout else 1
        what = f"'{name}' ({type(module).__name__} weight {tuple(module.weight.shape)})"
        self.weight = self._new_param(module.weight, _shard(module.weight.detach(), in_dim, self.tp_index,
                                                             self.tp_world_size, 1, what))
        mark_tensor_parallel(self.weight, in_dim, 1)
        if module.bias is not None:
            self.bias = module.bias  # replicated
        else:
            self.register_parameter("bias", None)
        self.in_features = self.weight.shape[in_dim]
        self.out_features = module.weight.shape[1 if self.conv1d_layout else 0]
        self._full_dim = self.weight.shape[in_dim] * self.tp_world_size
        self._bind(self.weight)

    def forward(self, input):  # noqa: A002
        out = input @ self.weight if self.conv1d_layout else F.linear(input, self.weight)
        if self.tp_world_size > 1:
            out = reduce_from_tensor_model_parallel_region(out, self.mp_group)
        return out + self.bias if self.bias is not None else out
