"""Collectives autograd can differentiate through: ``all_to_all`` of rows.

Rows of ``x`` (dim 0) are cut into consecutive pieces, piece ``r`` going to rank ``r`` of ``group``
(``send[r]`` rows each, or equal pieces), and the result holds, in rank order, the rows each rank sent
here (``recv[r]``). Its gradient is the reverse exchange of the incoming gradient. MoE's token dispatch
(equal pieces of capacity, or AutoEP's uneven routes) and Ulysses' head/sequence exchange use it.
"""

from __future__ import annotations

import torch

from shardwise.comm.comm import all_to_all_single

__all__ = ["all_to_all"]


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group, x: torch.Tensor, send, recv) -> torch.Tensor:
        ctx.group, ctx.send, ctx.recv = group, send, recv
        x = x.contiguous()
        out = torch.empty_like(x) if recv is None else x.new_empty((sum(recv), *x.shape[1:]))
        all_to_all_single(out, x, output_split_sizes=recv, input_split_sizes=send, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return None, _AllToAll.apply(ctx.group, grad, ctx.recv, ctx.send), None, None


def all_to_all(x: torch.Tensor, *, group, send: list[int] | None = None,
               recv: list[int] | None = None) -> torch.Tensor:
    """Exchange the rows of ``x`` over ``group`` (see the module docstring); differentiable."""
    return _AllToAll.apply(group, x, send, recv)
