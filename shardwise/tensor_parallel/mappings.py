"""Autograd-aware collectives at the borders of tensor-parallel regions (Megatron's mappings).

Each function takes ``group=``: a process group, None for the whole world (as everywhere in shardwise),
or by default ``TENSOR_AXIS``, the active grid's tensor-parallel group (see
``shardwise.topology.active_grid``); with a tensor size of 1 every one is the identity.

=========================================  ===========================  ==========================
function                                   forward                      backward
=========================================  ===========================  ==========================
copy_to_tensor_model_parallel_region       identity                     all-reduce
reduce_from_tensor_model_parallel_region   all-reduce                   identity
scatter_to_tensor_model_parallel_region    keep my slice of last dim    all-gather last dim
gather_from_tensor_model_parallel_region   all-gather last dim          keep my slice
scatter_to_sequence_parallel_region        keep my slice of ``dim``     all-gather ``dim``
gather_from_sequence_parallel_region       all-gather ``dim``           reduce-scatter ``dim``
reduce_scatter_to_sequence_parallel_region reduce-scatter ``dim``       all-gather ``dim``
=========================================  ===========================  ==========================

The sequence functions split along ``dim`` (0 by default: Megatron's ``[seq, batch, hidden]``).
"""

from __future__ import annotations

import torch

from shardwise import comm
from shardwise.topology import TENSOR_AXIS, tensor_parallel_group_and_size

__all__ = ["copy_to_tensor_model_parallel_region", "reduce_from_tensor_model_parallel_region",
           "scatter_to_tensor_model_parallel_region", "gather_from_tensor_model_parallel_region",
           "scatter_to_sequence_parallel_region", "gather_from_sequence_parallel_region",
           "reduce_scatter_to_sequence_parallel_region"]


def _rank(group) -> int:
    return comm.get_rank(group)


def _split(x: torch.Tensor, dim: int, group, size: int) -> torch.Tensor:
    if x.shape[dim] % size:
        raise ValueError(f"tensor-parallel split: dimension {dim} of a tensor of shape {tuple(x.shape)} "
                         f"is not divisible by the tensor-parallel size {size}")
    return x.chunk(size, dim=dim)[_rank(group)].contiguous()


def _all_gather(x: torch.Tensor, dim: int, group, size: int) -> torch.Tensor:
    moved = x.movedim(dim, 0).contiguous()
    out = torch.empty((size * moved.shape[0],) + tuple(moved.shape[1:]), dtype=x.dtype, device=x.device)
    comm.all_gather_into_tensor(out, moved, group=group)
    return out.movedim(0, dim).contiguous()


def _reduce_scatter(x: torch.Tensor, dim: int, group, size: int) -> torch.Tensor:
    if x.shape[dim] % size:
        raise ValueError(f"sequence-parallel reduce-scatter: dimension {dim} of shape {tuple(x.shape)} is not "
                         f"divisible by the tensor-parallel size {size}")
    moved = x.movedim(dim, 0).contiguous()
    out = torch.empty((moved.shape[0] // size,) + tuple(moved.shape[1:]), dtype=x.dtype, device=x.device)
    comm.reduce_scatter_tensor(out, moved, group=group)
    return out.movedim(0, dim).contiguous()


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    x = x.contiguous().clone()
    comm.all_reduce(x, group=group)
    return x


class _Copy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, size):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return _all_reduce(g, ctx.group), None, None


class _Reduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, size):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, g):
        return g, None, None


class _Scatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, size, dim):
        ctx.group, ctx.size, ctx.dim = group, size, dim
        return _split(x, dim, group, size)

    @staticmethod
    def backward(ctx, g):
        return _all_gather(g, ctx.dim, ctx.group, ctx.size), None, None, None


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, size, dim):
        ctx.group, ctx.size, ctx.dim = group, size, dim
        return _all_gather(x, dim, group, size)

    @staticmethod
    def backward(ctx, g):
        return _split(g, ctx.dim, ctx.group, ctx.size), None, None, None


class _GatherReduceScatterGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, size, dim):
        ctx.group, ctx.size, ctx.dim = group, size, dim
        return _all_gather(x, dim, group, size)

    @staticmethod
    def backward(ctx, g):
        return _reduce_scatter(g, ctx.dim, ctx.group, ctx.size), None, None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, size, dim):
        ctx.group, ctx.size, ctx.dim = group, size, dim
        return _reduce_scatter(x, dim, group, size)

    @staticmethod
    def backward(ctx, g):
        return _all_gather(g, ctx.dim, ctx.group, ctx.size), None, None, None


def copy_to_tensor_model_parallel_region(x: torch.Tensor, group=TENSOR_AXIS) -> torch.Tensor:
    group, size = tensor_parallel_group_and_size(group)
    return x if size == 1 else _Copy.apply(x, group, size)


def reduce_from_tensor_model_parallel_region(x: torch.Tensor, group=TENSOR_AXIS) -> torch.Tensor:
    group, size = tensor_parallel_group_and_size(group)
    return x if size == 1 else _Reduce.apply(x, group, size)


def scatter_to_tensor_model_parallel_region(x: torch.Tensor, group=TENSOR_AXIS) -> torch.Tensor:
    group, size = tensor_parallel_group_and_size(group)
    return x if size == 1 else _Scatter.apply(x, group, size, x.dim() - 1)


def gather_from_tensor_model_parallel_region(x: torch.Tensor, group=TENSOR_AXIS) -> torch.Tensor:
    group, size = tensor_parallel_group_and_size(group)
    return x if size == 1 else _Gather.apply(x, group, size, x.dim() - 1)


def scatter_to_sequence_parallel_region(x: torch.Tensor, group=TENSOR_AXIS, *, dim: int = 0) -> torch.Tensor:
    group, size = tensor_parallel_group_and_size(group)
    return x if size == 1 else _Scatter.apply(x, group, size, dim)


def gather_from_sequence_parallel_region(x: torch.Tensor, group=TENSOR_AXIS, *, dim: int = 0,
                                         tensor_parallel_output_grad: bool = True) -> torch.Tensor:
    """All-gather the sequence shards. Backward reduce-scatters (the consumer is tensor-parallel, so each
    rank's gradient is a partial sum), or only splits with ``tensor_parallel_output_grad=False``."""
    group, size = tensor_parallel_group_and_size(group)
    if size == 1:
        return x
    fn = _GatherReduceScatterGrad if tensor_parallel_output_grad else _Gather
    return fn.apply(x, group, size, dim)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, group=TENSOR_AXIS, *, dim: int = 0) -> torch.Tensor:
    group, size = tensor_parallel_group_and_size(group)
    return x if size == 1 else _ReduceScatter.apply(x, group, size, dim)
