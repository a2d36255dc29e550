"""``DistributedAttention``: DeepSpeed's ``deepspeed.sequence.layer.DistributedAttention``.

Wraps a local attention module: query/key/value arrive sharded along the sequence (``gather_idx``)
with all heads (``scatter_idx``); an all-to-all turns them into the whole sequence for ``heads/N``
heads, ``local_attention`` runs, and the reverse all-to-all returns the context sharded along the
sequence again. Both exchanges are differentiable.
"""

from __future__ import annotations

from typing import Any

import torch

from shardwise import comm
from shardwise.runtime.sequence_parallel.ulysses_sp import _all_to_all


def _seq_all_to_all(x: torch.Tensor, scatter_idx: int, gather_idx: int, group) -> torch.Tensor:
    """Cut ``x`` into N chunks along ``scatter_idx``, send chunk j to rank j, and join what arrives
    along ``gather_idx`` in rank order."""
    ws = comm.get_world_size(group)
    if x.shape[scatter_idx] % ws:
        raise ValueError(f"DistributedAttention: dimension {scatter_idx} of a {tuple(x.shape)} input (the heads) "
                         f"is not divisible by the sequence parallel size {ws}")
    received = _all_to_all(group, torch.stack(x.chunk(ws, dim=scatter_idx)))
    return torch.cat(received.unbind(0), dim=gather_idx)


class _SumOverGroup(torch.autograd.Function):
    """Sum over the sequence group; every rank then holds the same whole value (a loss), and its gradient
    is summed back, so each rank's share is scaled like the others (the engine averages over the group)."""

    @staticmethod
    def forward(ctx, group, x: torch.Tensor) -> torch.Tensor:
        ctx.group = group
        out = x.clone()
        comm.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.clone()
        comm.all_reduce(grad, group=ctx.group)
        return None, grad


def sequence_sum(x: torch.Tensor, group) -> torch.Tensor:
    """``x`` summed over the sequence-parallel ``group`` (differentiable): e.g. the loss sum of the whole
    sequences from each rank's slice, as ``shardwise.models.gpt.gpt_loss`` combines it."""
    return _SumOverGroup.apply(group, x)


def seq_all_to_all(x: torch.Tensor, scatter_idx: int, gather_idx: int, group) -> torch.Tensor:
    """Ulysses' exchange (differentiable): ``x`` cut along ``scatter_idx`` (the heads) goes to the ranks
    of ``group``, and what arrives is joined along ``gather_idx`` (the sequence) in rank order."""
    return _seq_all_to_all(x, scatter_idx, gather_idx, group)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.reshape(*x.shape[:-1], 2, x.shape[-1] // 2).unbind(dim=-2)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(t: torch.Tensor, freqs_cos: torch.Tensor, freqs_sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding on the first ``freqs.shape[-1]`` channels of ``t`` ([seq, ..., dim])."""
    rot = freqs_cos.shape[-1]
    t, rest = t[..., :rot], t[..., rot:]
    t = t * freqs_cos + _rotate_half(t) * freqs_sin
    return t if rest.shape[-1] == 0 else torch.cat((t, rest), dim=-1)


class DistributedAttention(torch.nn.Module):
    """DeepSpeed's arguments: ``local_attention`` (called as ``local_attention(q, k, v, *args, **kwargs)``),
    ``sequence_process_group``, ``scatter_idx`` (the heads dimension, default 2), ``gather_idx`` (the
    sequence dimension, default 0), ``sp_stream`` (accepted; the exchanges are not overlapped here),
    ``num_kv_heads`` (only even splits of the heads are supported)."""

    def __init__(self, local_attention: torch.nn.Module, sequence_process_group, scatter_idx: int = 2,
                 gather_idx: int = 0, sp_stream=None, num_kv_heads: int | None = None) -> None:
        super().__init__()
        self.local_attn = local_attention
        self.spg = sequence_process_group
        self.scatter_idx = scatter_idx
        self.gather_idx = gather_idx
        self.sp_stream = sp_stream
        self.num_kv_heads = num_kv_heads

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, batch_dim_idx: int,
                rotary_pos_emb=None, *args: Any, **kwargs: Any) -> torch.Tensor:
        q, k, v = (_seq_all_to_all(t, self.scatter_idx, self.gather_idx, self.spg) for t in (query, key, value))
        if rotary_pos_emb is not None:  # [seq, batch, ...] frequencies of the whole sequence, as DeepSpeed
            cos, sin = rotary_pos_emb[0].permute(1, 0, 2, 3), rotary_pos_emb[1].permute(1, 0, 2, 3)
            q, k = apply_rotary_pos_emb(q, cos, sin), apply_rotary_pos_emb(k, cos, sin)
        context = self.local_attn(q, k, v, *args, **kwargs)
        return _seq_all_to_all(context, self.gather_idx, self.scatter_idx, self.spg)
