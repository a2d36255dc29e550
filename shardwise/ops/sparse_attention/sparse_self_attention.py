"""``SparseSelfAttention``: DeepSpeed's block-sparse self-attention module on ``flex_attention``.

DeepSpeed computed it with Triton block-sparse kernels (removed from DeepSpeed since); here the
layout of a ``SparsityConfig`` becomes a ``torch.nn.attention.flex_attention.BlockMask`` whose
blocks are the layout's, so only the layout's blocks are computed.  Semantics are DeepSpeed's:
``softmax(q k^T * head_dim**-0.5 + rpe + key_padding_mask + attn_mask)`` over the keys the
layout lets each query see, then times ``v``; a mask in ``"mul"`` mode is 1 (keep) / 0 (drop),
in ``"add"`` mode it is added to the scores.

Backward: on CUDA (and other devices flex_attention trains on) flex_attention's own.  torch's
flex_attention has no backward on CPU, so there the forward runs flex_attention and the backward
is computed here, a chunk of block rows at a time, on the same layout blocks only
(``_BlockSparseAttention``).  The masks and ``rpe`` get no gradient.

``torch.compile`` of flex_attention gives the fused kernels (a C++ compiler is needed on CPU);
without it flex_attention runs an unfused reference that computes every score.  It is on by
default except on CPU; ``SparseSelfAttention(..., compile=True/False)`` or the environment
variable ``SHARDWISE_SPARSE_ATTENTION_COMPILE=1/0`` choose.
"""

from __future__ import annotations

import functools
import math
import os

import torch
import torch.nn as nn

from shardwise.ops.sparse_attention.sparsity_config import SparsityConfig

__all__ = ["SparseSelfAttention"]

_MODES = ("add", "mul")


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def _flex(compiled: bool):
    if compiled:
        return _compiled_flex()
    from torch.nn.attention.flex_attention import flex_attention

    return flex_attention


class _Mods:
    """The score and mask functions of one call (flex_attention's ``score_mod`` / ``mask_mod``),
    also evaluated on whole index tensors by the CPU backward (index arguments broadcast).  They
    are closures made by one factory, so compiled flex_attention sees the same code every call
    and guards only on the captured tensors' shapes (no recompilation per call)."""

    def __init__(self, layout: torch.Tensor, block: int, kp_add, kp_keep, am_add, am_keep, rpe) -> None:
        self.block = block
        self.shared = layout.shape[0] == 1
        self.kp_keep, self.am_keep = kp_keep, am_keep
        self.has_score_mod = any(t is not None for t in (kp_add, am_add, rpe))
        self.score_mod = _score_mod(kp_add, am_add, rpe)
        self.mask_mod = _mask_mod(layout.bool(), block, kp_keep, am_keep)


def _score_mod(kp_add, am_add, rpe):
    def score_mod(score, b, h, q, kv):
        if rpe is not None:
            score = score + rpe[b, h, q, kv]
        if kp_add is not None:
            score = score + kp_add[b, kv]
        if am_add is not None:
            score = score + am_add[q, kv]
        return score

    return score_mod


def _mask_mod(layout, block, kp_keep, am_keep):
    shared = layout.shape[0] == 1

    def mask_mod(b, h, q, kv):
        keep = layout[h * 0 if shared else h, q // block, kv // block]
        if kp_keep is not None:
            keep = keep & kp_keep[b, kv]
        if am_keep is not None:
            keep = keep & am_keep[q, kv]
        return keep

    return mask_mod


class _Blocks:
    """A layout as per-row lists of key blocks, padded to the longest row (``valid`` marks real ones)."""

    def __init__(self, layout: torch.Tensor) -> None:
        lay = layout.bool()
        self.counts = lay.sum(-1).to(torch.int32)  # [Hl, nb]
        width = max(1, int(self.counts.max()))
        order = torch.argsort((~lay).to(torch.int8), dim=-1, stable=True)  # present blocks first, in order
        self.indices = order.to(torch.int32).contiguous()  # [Hl, nb, nb]
        self.cols = order[..., :width]  # [Hl, nb, width]
        self.valid = torch.arange(width) < self.counts[..., None]


class _BlockSparseAttention(torch.autograd.Function):
    """flex_attention forward; a block-sparse backward in plain torch (for devices where
    flex_attention has none, i.e. CPU)."""

    @staticmethod
    def forward(ctx, q, k, v, block_mask, mods, blocks, scale, compiled):
        # (compiled flex_attention on CPU cannot return the log-sum-exp: backward recomputes it per row)
        out = _flex(compiled)(q.detach(), k.detach(), v.detach(),
                              score_mod=mods.score_mod if mods.has_score_mod else None, block_mask=block_mask,
                              scale=scale)
        ctx.save_for_backward(q, k, v, out)
        ctx.mods, ctx.blocks, ctx.scale = mods, blocks, scale
        return out

    @staticmethod
    def backward(ctx, d_out):
        q, k, v, out = ctx.saved_tensors
        mods, blocks, scale = ctx.mods, ctx.blocks, ctx.scale
        B, H, L, D = q.shape
        blk = mods.block
        nb = L // blk
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        delta = (d_out.float() * out.float()).sum(-1)  # [B, H, L]
        width = blocks.cols.shape[-1]
        rows_per_chunk = max(1, (1 << 22) // max(1, B * H * blk * width * blk))  # ~16 MB of scores per chunk
        b_idx = torch.arange(B, device=q.device).view(B, 1, 1, 1, 1)
        h_idx = torch.arange(H, device=q.device).view(1, H, 1, 1, 1)
        cols_all = blocks.cols.to(q.device)
        valid_all = blocks.valid.to(q.device)
        offs = torch.arange(blk, device=q.device)
        hl = cols_all.shape[0]
        head_base = (torch.arange(H, device=q.device) * L).view(H, 1, 1)
        padded = not bool(valid_all.all())
        elementwise = mods.kp_keep is not None or mods.am_keep is not None
        for r0 in range(0, nb, rows_per_chunk):
            r1 = min(nb, r0 + rows_per_chunk)
            R, span = r1 - r0, slice(r0 * blk, r1 * blk)
            tok = (cols_all[:, r0:r1, :, None] * blk + offs).reshape(hl, R, width * blk)  # the rows' key positions
            if mods.shared:
                kg, vg = k[:, :, tok[0]], v[:, :, tok[0]]  # [B, H, R, W*blk, D]
            else:
                kg, vg = k[:, h_idx.view(H, 1, 1), tok], v[:, h_idx.view(H, 1, 1), tok]
            qc = q[:, :, span].reshape(B, H, R, blk, D) * scale
            doc = d_out[:, :, span].reshape(B, H, R, blk, D)
            s = torch.matmul(qc, kg.transpose(-1, -2))  # [B, H, R, blk, W*blk]
            kv_pos = tok.view(1, hl, R, 1, width * blk)
            if mods.has_score_mod:
                q_pos = torch.arange(r0 * blk, r1 * blk, device=q.device).view(1, 1, R, blk, 1)
                s = mods.score_mod(s, b_idx, h_idx, q_pos, kv_pos)
            # the gathered blocks are the layout's: only the row padding and element masks remain
            keep = valid_all[:, r0:r1, :, None].expand(-1, -1, -1, blk).reshape(1, hl, R, 1, width * blk) \
                if padded else None
            if mods.kp_keep is not None:
                k_keep = mods.kp_keep[b_idx, kv_pos]
                keep = k_keep if keep is None else keep & k_keep
            if mods.am_keep is not None:
                a_keep = mods.am_keep[torch.arange(r0 * blk, r1 * blk, device=q.device).view(1, 1, R, blk, 1),
                                      kv_pos]
                keep = a_keep if keep is None else keep & a_keep
            if keep is not None:
                s = s.masked_fill(~keep, float("-inf"))
            # a chunk holds every key block of its rows, so the softmax is recomputed exactly here
            p = torch.softmax(s.float(), dim=-1)
            if elementwise:
                p = torch.nan_to_num(p, nan=0.0)  # rows whose keys are all masked
            p = p.to(q.dtype)
            ds = torch.matmul(doc, vg.transpose(-1, -2))  # dP, then dS in place
            ds.sub_(delta[:, :, span].reshape(B, H, R, blk, 1).to(ds.dtype)).mul_(p)
            dq[:, :, span] = (torch.matmul(ds, kg) * scale).reshape(B, H, R * blk, D)
            dk_part = torch.matmul(ds.transpose(-1, -2), qc)  # [B, H, R, W*blk, D] (qc carries the scale)
            dv_part = torch.matmul(p.transpose(-1, -2), doc)
            flat = (head_base + (tok.reshape(1, 1, -1) if mods.shared else tok.reshape(H, 1, -1))).reshape(-1)
            dk.view(B, H * L, D).index_add_(1, flat, dk_part.reshape(B, -1, D))
            dv.view(B, H * L, D).index_add_(1, flat, dv_part.reshape(B, -1, D))
        return dq, dk, dv, None, None, None, None, None


class SparseSelfAttention(nn.Module):
    """Block-sparse self-attention (Child et al. 2019) with DeepSpeed's constructor and forward.

    ``sparsity_config``: a ``SparsityConfig`` (its layout for ``max_seq_length`` tokens is the
    ``master_layout`` buffer; shorter sequences use its top-left corner);
    ``key_padding_mask_mode`` / ``attn_mask_mode``: ``"add"`` or ``"mul"``.
    ``forward(query, key, value, rpe=None, key_padding_mask=None, attn_mask=None)`` takes
    ``[batch, heads, seq, head_dim]`` tensors (``key`` may come transposed, ``[.., head_dim, seq]``),
    a key padding mask ``[batch, seq]`` (or with extra singleton dimensions) and an attention
    mask ``[seq, seq]``, and returns ``[batch, heads, seq, head_dim]``.
    """

    def __init__(self, sparsity_config=None, key_padding_mask_mode="add", attn_mask_mode="mul",
                 max_seq_length=2048, *, compile: bool | None = None):
        super().__init__()
        if sparsity_config is None:
            sparsity_config = SparsityConfig(num_heads=4)
        for name, mode in (("key_padding_mask_mode", key_padding_mask_mode), ("attn_mask_mode", attn_mask_mode)):
            if mode not in _MODES:
                raise ValueError(f"SparseSelfAttention: {name}={mode!r}: must be 'add' or 'mul'")
        self.sparsity_config = sparsity_config
        self.register_buffer("master_layout", sparsity_config.make_layout(max_seq_length))
        self._need_layout_synchronization = True
        self.key_padding_mask_mode = key_padding_mask_mode
        self.attn_mask_mode = attn_mask_mode
        self.compile = compile
        self._blocks: dict[tuple, tuple] = {}

    def _use_compile(self, device: torch.device) -> bool:
        if self.compile is not None:
            return self.compile
        env = os.environ.get("SHARDWISE_SPARSE_ATTENTION_COMPILE")
        if env is not None:
            return env.strip().lower() not in ("0", "false", "no", "")
        return device.type != "cpu"

    def get_layout(self, L):
        """The layout for ``L`` tokens (rank 0's, broadcast once: random layouts differ per rank)."""
        if self._need_layout_synchronization:
            from shardwise import comm

            if comm.is_initialized() and comm.get_world_size() > 1:
                comm.broadcast(self.master_layout, src=0)
            self._need_layout_synchronization = False
        block = self.sparsity_config.block
        if L % block != 0:
            raise ValueError(f"Sequence Length, {L}, needs to be dividable by Block size {block}!")
        if L > self.master_layout.shape[-1] * block:
            raise ValueError(f"SparseSelfAttention: sequence length {L} exceeds max_seq_length "
                             f"{self.master_layout.shape[-1] * block} the layout was built for")
        n = L // block
        return self.master_layout[..., :n, :n]

    def _structure(self, L: int, device: torch.device):
        key = (L, str(device))
        if key not in self._blocks:
            layout = self.get_layout(L)
            if bool((layout == layout[:1]).all()):
                layout = layout[:1]  # one layout for every head
            layout = layout.to(device)
            self._blocks[key] = (layout, _Blocks(layout.cpu()))
        return self._blocks[key]

    @staticmethod
    def transpose_key_for_scores(x, L):
        return x.transpose(-1, -2) if x.shape[2] != L else x

    @staticmethod
    def _mask(mask, dtype, mode, *, key_padding: bool):
        if mask is None:
            return None, None
        if key_padding:  # [B, 1, 1, L] and the like -> [B, L]
            mask = mask.reshape(mask.shape[0], mask.shape[-1])
        else:
            mask = mask.squeeze()
            if mask.dim() != 2:
                raise ValueError(f"SparseSelfAttention: attn_mask must be [seq, seq], got {tuple(mask.shape)}")
        if mode == "mul":
            return None, mask != 0
        return mask.to(dtype), None

    def forward(self, query, key, value, rpe=None, key_padding_mask=None, attn_mask=None):
        B, H, L, D = query.shape
        key = self.transpose_key_for_scores(key, L)
        if query.shape != key.shape or key.shape != value.shape:
            raise NotImplementedError(f"only self-attention is supported: query {tuple(query.shape)}, key "
                                      f"{tuple(key.shape)}, value {tuple(value.shape)} differ")
        if H != self.sparsity_config.num_heads:
            raise ValueError(f"SparseSelfAttention: {H} heads in the input, the sparsity config has "
                             f"{self.sparsity_config.num_heads}")
        layout, blocks = self._structure(L, query.device)
        kp_add, kp_keep = self._mask(key_padding_mask, query.dtype, self.key_padding_mask_mode, key_padding=True)
        am_add, am_keep = self._mask(attn_mask, query.dtype, self.attn_mask_mode, key_padding=False)
        if rpe is not None:
            rpe = rpe.to(query.dtype).expand(B, H, L, L)
        mods = _Mods(layout, self.sparsity_config.block, kp_add, kp_keep, am_add, am_keep, rpe)
        compiled = self._use_compile(query.device)
        block_mask = self._block_mask(layout, blocks, mods, L, query.device, compiled)
        scale = float(D) ** -0.5
        needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
        if query.device.type == "cpu" and needs_grad:
            return _BlockSparseAttention.apply(query, key, value, block_mask, mods, blocks, scale, compiled)
        return _flex(compiled)(query, key, value, score_mod=mods.score_mod if mods.has_score_mod else None,
                               block_mask=block_mask, scale=scale)

    def _block_mask(self, layout, blocks, mods, L, device, compiled):
        from torch.nn.attention.flex_attention import BlockMask

        hl = layout.shape[0]
        counts = blocks.counts.to(device).view(1, hl, -1)
        indices = blocks.indices.to(device).view(1, hl, *blocks.indices.shape[1:])
        elementwise = mods.kp_keep is not None or mods.am_keep is not None
        if elementwise:  # the layout's blocks need the element masks: "partial" blocks
            return BlockMask.from_kv_blocks(counts, indices, None, None, BLOCK_SIZE=self.sparsity_config.block,
                                            mask_mod=mods.mask_mod, seq_lengths=(L, L))
        # every layout block is computed whole ("full" blocks).  The fused kernels need no mask_mod
        # then (evaluating the layout look-up per score made the CPU kernel ~4x slower); the unfused
        # reference ignores the block structure and evaluates mask_mod on every score, so it gets
        # the layout as mask_mod.  (Distinct index tensors: inductor's CPU template breaks when one
        # buffer is passed as both.)
        return BlockMask.from_kv_blocks(torch.zeros_like(counts), indices.clone(), counts, indices,
                                        BLOCK_SIZE=self.sparsity_config.block,
                                        mask_mod=None if compiled else mods.mask_mod, seq_lengths=(L, L))
