"""The one exchange AutoSP needs: every rank's slice of a sequence, joined in rank order on every rank.

Slices may differ in length (5 patches over 2 ranks: 3 and 2). Built on ``comm.autograd.all_to_all``
(each rank sends its whole slice to every rank), so it is differentiable: the gradient a rank computes
for the whole sequence goes back in pieces, each slice's owner receiving and summing its piece.
"""

from __future__ import annotations

import torch

from shardwise import comm
from shardwise.comm.autograd import all_to_all


def slice_lengths(n: int, group, device) -> list[int]:
    """The sequence length each rank of ``group`` holds, in rank order."""
    ws = comm.get_world_size(group)
    mine = torch.tensor([n], dtype=torch.long, device=device)
    lens = [torch.zeros_like(mine) for _ in range(ws)]
    comm.all_gather(lens, mine, group=group)
    return [int(t.item()) for t in lens]


def gather_sequence(x: torch.Tensor, group, *, dim: int = 1) -> tuple[torch.Tensor, list[int]]:
    """``x`` (this rank's slice along ``dim``) joined with every other rank's, in rank order, and the
    slices' lengths. Differentiable."""
    ws = comm.get_world_size(group)
    if ws == 1:
        return x, [x.shape[dim]]
    n = x.shape[dim]
    lens = slice_lengths(n, group, x.device)
    rows = x.movedim(dim, 0)
    full = all_to_all(torch.cat([rows] * ws), group=group, send=[n] * ws, recv=lens)
    return full.movedim(0, dim), lens
