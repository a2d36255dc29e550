"""Dropless token exchange and grouped expert computation.

Every route (token, choice) is sent to the rank holding its expert: the routes are sorted by expert, the
per-expert counts exchanged (one small all-to-all), then the rows themselves with an all-to-all of
uneven splits; the receiving rank regroups them by local expert, runs each expert on its rows (one
``torch._grouped_mm`` per projection on CUDA, one ``F.linear`` per expert elsewhere), and the outputs go
back the same way. No route is dropped and nothing is padded.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from shardwise import comm


def exchange_counts(counts: Tensor, *, ep_size: int, group) -> Tensor:
    """``[ep_size, local experts]``: how many routes each rank of the group sends to each local expert."""
    received = torch.empty_like(counts)
    comm.all_to_all_single(received, counts.contiguous(), group=group)
    return received.view(ep_size, -1)


def run_experts(rows: Tensor, counts: list[int], w13: Tensor, w2: Tensor, act, *, grouped: bool) -> Tensor:
    """``rows`` grouped by local expert (``counts[e]`` rows each); expert e computes
    ``act(gate) * up @ w2[e]`` with ``[gate, up] = rows @ w13[e].T``."""
    if grouped and _grouped_mm_fits(rows, w13, w2):
        offs = torch.tensor(counts, device=rows.device).cumsum(0).to(torch.int32)
        h = torch._grouped_mm(rows, w13.transpose(-2, -1), offs=offs)
        gate, up = h.chunk(2, dim=-1)
        return torch._grouped_mm(act(gate) * up, w2.transpose(-2, -1), offs=offs)
    outs, start = [], 0
    for e, n in enumerate(counts):
        if n:
            gate, up = F.linear(rows[start:start + n], w13[e]).chunk(2, dim=-1)
            outs.append(F.linear(act(gate) * up, w2[e]))
        start += n
    if not outs:  # no route reached these experts: an empty result still joins the autograd graph
        return rows[:0, :w2.shape[1]] * 0 + (w13.sum() + w2.sum()) * 0
    return torch.cat(outs)


def _grouped_mm_fits(rows: Tensor, w13: Tensor, w2: Tensor) -> bool:
    """CUDA, bf16, and rows of a multiple of 16 bytes (what ``torch._grouped_mm`` takes)."""
    return (rows.is_cuda and hasattr(torch, "_grouped_mm") and rows.dtype == w13.dtype == torch.bfloat16
            and rows.shape[1] % 8 == 0 and w2.shape[2] % 8 == 0)


def expert_ids_of(received: Tensor) -> Tensor:
    """For rows received as [source rank][local expert] blocks of ``received[s, e]`` rows: each row's expert."""
    ep_size, local = received.shape
    ids = torch.arange(local, device=received.device).repeat(ep_size)
    return torch.repeat_interleave(ids, received.reshape(-1))
