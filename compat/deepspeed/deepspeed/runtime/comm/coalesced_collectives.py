"""``deepspeed.runtime.comm.coalesced_collectives``: ``reduce_scatter_coalesced`` on shardwise.comm's
reduce-scatter (gloo included). The quantized all-to-all of ZeRO++ (``all_to_all_quant_reduce``,
``all_to_all_loco_quant_reduce``) is not implemented: shardwise reduces gradients in full precision.
"""
from __future__ import annotations

import math

import torch

from shardwise import comm

__all__ = ["reduce_scatter_coalesced", "all_to_all_quant_reduce", "all_to_all_loco_quant_reduce"]


@torch.no_grad()
def reduce_scatter_coalesced(tensors: list[torch.Tensor], group=None) -> list[torch.Tensor]:
    """Average each tensor over ``group`` and give back this rank's part of each, in one reduce-scatter.

    A tensor of ``N`` elements is cut, flattened, into parts of ``ceil(N / world)`` elements, rank ``r``
    owning the ``r``-th (the last parts are shorter, or empty when ``N < world``). The tensors are divided
    by the world size before the sum, so fp16 ones do not overflow.
    """
    world, rank = comm.get_world_size(group), comm.get_rank(group)
    parts = [math.ceil(t.numel() / world) for t in tensors]
    width = sum(parts)
    send = tensors[0].new_zeros(world * width)
    for j in range(world):  # rank j's parts of every tensor, side by side
        at = j * width
        for t, p in zip(tensors, parts):
            piece = t.detach().reshape(-1)[j * p:(j + 1) * p]
            send[at:at + piece.numel()].copy_(piece)
            at += p
    send.div_(world)
    mine = torch.empty(width, dtype=send.dtype, device=send.device)
    comm.reduce_scatter_tensor(mine, send, group=group)
    out, at = [], 0
    for t, p in zip(tensors, parts):
        length = max(0, min(p, t.numel() - rank * p))
        out.append(mine[at:at + length])
        at += p
    return out


def all_to_all_quant_reduce(tensors, groups, *args, **kwargs):
    raise NotImplementedError("all_to_all_quant_reduce, DeepSpeed's internal qgZ collective, is not provided: set "
                              "zero_quantized_gradients in zero_optimization and the engine reduces gradients with "
                              "its own qgZ (shardwise/zero/qgz.py)")


def all_to_all_loco_quant_reduce(*args, **kwargs):
    raise NotImplementedError("all_to_all_loco_quant_reduce, DeepSpeed's internal qgZ + LoCo collective, is not "
                              "provided: set zero_quantized_gradients and zeropp_loco_param in zero_optimization and "
                              "the engine reduces gradients with its own qgZ and LoCo (shardwise/zero/qgz.py)")
