"""Cache-sized chunked optimizer updates for tensors torch has no fused kernel for.

torch's multi-tensor (``foreach``) path streams every state tensor through
memory once per elementary op and allocates temporaries the size of the
parameters (``sign(c)`` for Lion, the update ``u`` for Lamb).  Here each
parameter is walked in chunks of ``CHUNK`` elements: a chunk of ``p``, ``g``
and the states stays in cache while all the ops of the update run on it, and
the only temporaries are a few chunk-sized scratch buffers reused for every
tensor.

The ops applied to a chunk are the ones of the reference implementation
(torch's single-tensor Adam/Adagrad, our foreach Lion/Lamb), so results agree
with it to rounding (the tests state the largest difference).  States may be
kept in a wider dtype than the parameter (``fp32_optimizer_states`` of
DeepSpeed's CPU optimizers): the chunk is then computed in the state dtype
and rounded once into the parameter.

Used for contiguous tensors on any device; on CUDA the foreach/fused paths
are usually faster (fewer launches), and callers pick accordingly.
"""

from __future__ import annotations

import math

import torch

CHUNK = 1 << 16  # elements per chunk: 256 KiB in fp32, a few of them fit in L2


class Scratch:
    """Chunk-sized work buffers, one set per (device, dtype), reused across steps."""

    def __init__(self) -> None:
        self._bufs: dict[tuple[torch.device, torch.dtype, int], torch.Tensor] = {}

    def get(self, slot: int, like: torch.Tensor, dtype: torch.dtype, n: int) -> torch.Tensor:
        key = (like.device, dtype, slot)
        buf = self._bufs.get(key)
        if buf is None:
            buf = self._bufs[key] = torch.empty(CHUNK, dtype=dtype, device=like.device)
        return buf[:n]


def can_chunk(*tensors: torch.Tensor) -> bool:
    """True when every tensor is dense, contiguous and of the same number of elements."""
    n = tensors[0].numel()
    return all(t.layout == torch.strided and t.is_contiguous() and t.numel() == n for t in tensors)


def _as(chunk: torch.Tensor, dtype: torch.dtype, scratch: Scratch, slot: int) -> torch.Tensor:
    """``chunk`` itself when it already has ``dtype``, else a scratch copy in ``dtype``."""
    if chunk.dtype == dtype:
        return chunk
    return scratch.get(slot, chunk, dtype, chunk.numel()).copy_(chunk)


def _spans(n: int):
    for start in range(0, n, CHUNK):
        yield start, min(n, start + CHUNK)


# Scratch slots: 0 param copy, 1 grad copy, 2 and 3 temporaries.


def lion_(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, *, lr: float, beta1: float, beta2: float,
          weight_decay: float, scratch: Scratch) -> None:
    """One Lion step of ``p`` in place (the ops of ``shardwise.optim.Lion``'s foreach update)."""
    dt = m.dtype
    pf, gf, mf = p.view(-1), g.view(-1), m.view(-1)
    for s, e in _spans(pf.numel()):
        pc, mc = pf[s:e], mf[s:e]
        pw, gw = _as(pc, dt, scratch, 0), _as(gf[s:e], dt, scratch, 1)
        c = torch.mul(mc, beta1, out=scratch.get(2, pc, dt, e - s))
        c.add_(gw, alpha=1.0 - beta1).sign_()
        if weight_decay != 0.0:
            pw.mul_(1.0 - lr * weight_decay)
        pw.add_(c, alpha=-lr)
        mc.mul_(beta2).add_(gw, alpha=1.0 - beta2)
        if pw is not pc:
            pc.copy_(pw)


def adam_(p: torch.Tensor, g: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *, step: float,
          lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, decoupled: bool,
          bias_correction: bool, scratch: Scratch) -> None:
    """One Adam/AdamW step of ``p`` in place (the ops of torch's single-tensor ``adam``)."""
    dt = exp_avg.dtype
    bc1 = 1.0 - beta1**step if bias_correction else 1.0
    bc2_sqrt = math.sqrt(1.0 - beta2**step) if bias_correction else 1.0
    step_size = lr / bc1
    pf, gf, af, vf = p.view(-1), g.view(-1), exp_avg.view(-1), exp_avg_sq.view(-1)
    for s, e in _spans(pf.numel()):
        pc, ac, vc = pf[s:e], af[s:e], vf[s:e]
        pw, gw = _as(pc, dt, scratch, 0), _as(gf[s:e], dt, scratch, 1)
        if weight_decay != 0.0:
            if decoupled:
                pw.mul_(1.0 - lr * weight_decay)
            else:
                gw = torch.add(gw, pw, alpha=weight_decay, out=scratch.get(3, pc, dt, e - s))
        ac.lerp_(gw, 1.0 - beta1)
        vc.mul_(beta2).addcmul_(gw, gw, value=1.0 - beta2)
        denom = torch.sqrt(vc, out=scratch.get(2, pc, dt, e - s))
        denom.div_(bc2_sqrt).add_(eps)
        pw.addcdiv_(ac, denom, value=-step_size)
        if pw is not pc:
            pc.copy_(pw)


def adagrad_(p: torch.Tensor, g: torch.Tensor, state_sum: torch.Tensor, *, step: float, lr: float, lr_decay: float,
             eps: float, weight_decay: float, scratch: Scratch) -> None:
    """One Adagrad step of ``p`` in place (the ops of torch's single-tensor ``adagrad``)."""
    dt = state_sum.dtype
    clr = lr / (1.0 + (step - 1.0) * lr_decay)
    pf, gf, sf = p.view(-1), g.view(-1), state_sum.view(-1)
    for s, e in _spans(pf.numel()):
        pc, sc = pf[s:e], sf[s:e]
        pw, gw = _as(pc, dt, scratch, 0), _as(gf[s:e], dt, scratch, 1)
        if weight_decay != 0.0:
            gw = torch.add(gw, pw, alpha=weight_decay, out=scratch.get(3, pc, dt, e - s))
        sc.addcmul_(gw, gw, value=1.0)
        std = torch.sqrt(sc, out=scratch.get(2, pc, dt, e - s)).add_(eps)
        pw.addcdiv_(gw, std, value=-clr)
        if pw is not pc:
            pc.copy_(pw)


def _lamb_update_chunk(ac, vc, pw, *, eps, eps_inside_sqrt, weight_decay, out):
    """u = m / (sqrt(v) + eps) + wd * p for one chunk, into ``out``."""
    if eps_inside_sqrt:
        torch.add(vc, eps, out=out).sqrt_()
    else:
        torch.sqrt(vc, out=out).add_(eps)
    torch.div(ac, out, out=out)
    if weight_decay != 0.0:
        out.add_(pw, alpha=weight_decay)
    return out


def lamb_(p: torch.Tensor, g: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *, step_size: float,
          beta1: float, beta2: float, eps: float, eps_inside_sqrt: bool, weight_decay: float, max_coeff: float,
          min_coeff: float, grad_divisor: float, scratch: Scratch) -> torch.Tensor:
    """One Lamb step of ``p`` in place; returns the trust ratio (a 0-d fp32 tensor).

    Two passes: the first updates the moments and accumulates ``||p||^2`` and
    ``||u||^2``; the second recomputes ``u`` chunk by chunk and applies it, so
    no parameter-sized ``u`` is ever held.  ``grad_divisor`` divides the
    gradient first (FusedLamb's ``scale`` / gradient clipping).
    """
    dt = exp_avg.dtype
    pf, gf, af, vf = p.view(-1), g.view(-1), exp_avg.view(-1), exp_avg_sq.view(-1)
    w_sq = torch.zeros((), dtype=torch.float64, device=p.device)
    u_sq = torch.zeros((), dtype=torch.float64, device=p.device)
    for s, e in _spans(pf.numel()):
        pc, ac, vc = pf[s:e], af[s:e], vf[s:e]
        pw, gw = _as(pc, dt, scratch, 0), _as(gf[s:e], dt, scratch, 1)
        if grad_divisor != 1.0:
            gw = torch.div(gw, grad_divisor, out=scratch.get(3, pc, dt, e - s))
        ac.mul_(beta1).add_(gw, alpha=1.0 - beta1)
        vc.mul_(beta2).addcmul_(gw, gw, value=1.0 - beta2)
        u = _lamb_update_chunk(ac, vc, pw, eps=eps, eps_inside_sqrt=eps_inside_sqrt, weight_decay=weight_decay,
                               out=scratch.get(2, pc, dt, e - s))
        pw32 = pw.float()
        u32 = u.float()
        w_sq += torch.dot(pw32, pw32)
        u_sq += torch.dot(u32, u32)
    w_norm, u_norm = w_sq.sqrt().float(), u_sq.sqrt().float()
    ratio = (w_norm / u_norm).clamp(min_coeff, max_coeff)
    coeff = torch.where((w_norm > 0) & (u_norm > 0), ratio, torch.ones_like(ratio))
    factor = float((coeff * -step_size).to(dt))
    for s, e in _spans(pf.numel()):
        pc, ac, vc = pf[s:e], af[s:e], vf[s:e]
        pw = _as(pc, dt, scratch, 0)
        u = _lamb_update_chunk(ac, vc, pw, eps=eps, eps_inside_sqrt=eps_inside_sqrt, weight_decay=weight_decay,
                               out=scratch.get(2, pc, dt, e - s))
        pw.add_(u.mul_(factor))
        if pw is not pc:
            pc.copy_(pw)
    return coeff
