"""Tiled compute along the sequence: ALST's ``TiledMLP``, ``TiledFusedLogitsLoss`` and
``SequenceTiledCompute`` / ``sequence_tiled_compute`` with DeepSpeed 0.19's names and arguments.

A position-wise computation (an MLP, the lm_head + loss) on a long sequence keeps a large
intermediate alive: ``[tokens, intermediate_size]`` for an MLP, ``[tokens, vocab]`` for the
logits.  These autograd functions cut the sequence into ``shards`` tiles and run the
computation one tile at a time without recording a graph; backward recomputes one tile at a
time and backpropagates it at once, so only one tile's intermediate is ever alive.  The
parameters' gradients accumulate over the tiles in ``param.grad``.

ZeRO: a parameter's gradient would normally be "ready" (handed to its reduction bucket) after
every tile.  The parameters listed in ``compute_params`` get ``param.ds_grad_is_ready = False``
for all tiles but the last, as in DeepSpeed; shardwise's ZeRO stages 0-3 wait for the last
tile (``zero/buckets.py``).  Under stage 3 the tiles run the modules' forward again, whose
hooks gather the partitioned parameters as in any forward.

``TiledFusedLogitsLoss`` differs from DeepSpeed in one respect: DeepSpeed backpropagates every
tile inside forward and adds the parameters' gradients then, so they ignore the gradient that
later arrives for the loss (``loss / gradient_accumulation_steps``, a loss scale, a weight).
Here the tiles' parameter gradients are summed aside in forward and handed to autograd in
backward, multiplied by that incoming gradient, like the input's gradient.  Under stage 3 the
parameters are gathered again for that hand-off (a released parameter is empty, and autograd
accumulates a gradient in its parameter's shape), as for the backward of any module's call, and
released once their gradients are in.
"""

from __future__ import annotations

import math

import torch

from shardwise.param_attrs import set_grad_is_ready
from shardwise.zero.coordinator import gather_for_gradients

__all__ = ["TiledMLP", "TiledFusedLogitsLoss", "SequenceTiledCompute", "sequence_tiled_compute"]


def _mark_ready(params, ready: bool) -> None:
    for p in params:
        set_grad_is_ready(p, ready)


def _trainable(params) -> list[torch.Tensor]:
    return [p for p in (params or []) if p.requires_grad]


def _leaf_like(t: torch.Tensor, requires_grad: bool) -> torch.Tensor:
    """A new autograd leaf sharing ``t``'s memory (a view of a detached tensor)."""
    return t.detach().requires_grad_(requires_grad)


def _row_ranges(n: int, shards: int) -> list[tuple[int, int]]:
    """The row ranges ``torch.chunk(rows, shards)`` cuts: tiles of ``ceil(n / shards)`` rows."""
    step = max(1, math.ceil(n / shards))
    return [(a, min(a + step, n)) for a in range(0, n, step)]


def _backward_into(out: torch.Tensor, grad: torch.Tensor, leaf: torch.Tensor, grad_slot: torch.Tensor | None) -> None:
    """Backpropagate ``out`` with ``grad``; ``leaf``'s gradient lands in ``grad_slot`` (a zeroed view
    of the whole input's gradient), other leaves (parameters) accumulate into their ``.grad``."""
    if grad_slot is not None and grad_slot.is_contiguous():
        leaf.grad = grad_slot  # autograd adds into an existing .grad in place: no tile-sized copy
    torch.autograd.backward(out, grad)
    if grad_slot is not None and leaf.grad is not grad_slot:
        grad_slot.copy_(leaf.grad)


def sequence_tiled_compute(fn, seqlen, shards, kwargs_to_shard, kwargs_to_pass, grad_requiring_tensor_key,
                           compute_params=None, output_unshard_dimension=1, output_reduction="mean"):
    """Run ``fn(**kwargs_to_shard_tile, **kwargs_to_pass)`` over ``shards`` tiles of the sequence.

    ``kwargs_to_shard``: tensors of shape ``[batch, seqlen, ...]`` cut along dimension 1 into tiles
    of ``ceil(seqlen / shards)``; ``kwargs_to_pass``: passed whole to every call.  Only
    ``kwargs_to_shard[grad_requiring_tensor_key]`` gets a gradient; parameters used by ``fn``
    accumulate theirs in ``.grad`` (list them in ``compute_params`` under ZeRO).  The tiles'
    outputs are concatenated along ``output_unshard_dimension`` (0: scalar outputs, stacked) and
    reduced by ``output_reduction``: ``None``, ``"mean"`` or ``"sum"``.
    """
    if output_reduction not in (None, "mean", "sum"):
        raise ValueError(f"sequence_tiled_compute: unknown output_reduction {output_reduction!r}: "
                         "valid values are None, 'mean' and 'sum'")
    keys = list(kwargs_to_shard) + list(kwargs_to_pass)
    if grad_requiring_tensor_key not in kwargs_to_shard:
        raise ValueError(f"sequence_tiled_compute: grad_requiring_tensor_key {grad_requiring_tensor_key!r} is not "
                         f"a key of kwargs_to_shard ({sorted(kwargs_to_shard)})")
    assert len(set(keys)) == len(keys), "a key is both in kwargs_to_shard and kwargs_to_pass"
    return SequenceTiledCompute.apply(fn, seqlen, shards, list(kwargs_to_shard), list(kwargs_to_pass),
                                      grad_requiring_tensor_key, compute_params, output_unshard_dimension,
                                      output_reduction, *kwargs_to_shard.values(), *kwargs_to_pass.values())


class SequenceTiledCompute(torch.autograd.Function):
    """The autograd function behind ``sequence_tiled_compute`` (which takes dicts; this takes the
    keys and then the values positionally).  ``fn`` runs once per tile in forward and again in
    backward."""

    @staticmethod
    def forward(ctx, fn, seqlen, shards, keys_to_shard, keys_to_pass, grad_requiring_tensor_key, compute_params,
                output_unshard_dimension, output_reduction, *args):
        n_shard = len(keys_to_shard)
        to_shard = dict(zip(keys_to_shard, args[:n_shard]))
        to_pass = dict(zip(keys_to_pass, args[n_shard:]))
        step = math.ceil(seqlen / shards)
        outs = []
        with torch.no_grad():
            for i in range(shards):
                outs.append(fn(**{k: v[:, i * step:(i + 1) * step] for k, v in to_shard.items()}, **to_pass))
        if output_unshard_dimension == 0:  # one (scalar) output per tile, stacked
            full = torch.cat([o.unsqueeze(0) for o in outs], dim=0)
        else:
            full = torch.cat(outs, dim=output_unshard_dimension)
        ctx.fn, ctx.seqlen, ctx.shards, ctx.step = fn, seqlen, shards, step
        ctx.to_shard, ctx.to_pass = to_shard, to_pass
        ctx.key = grad_requiring_tensor_key
        ctx.arg_index = (list(keys_to_shard) + list(keys_to_pass)).index(grad_requiring_tensor_key)
        ctx.n_args = len(args)
        ctx.compute_params = _trainable(compute_params)
        ctx.dim = output_unshard_dimension
        ctx.reduction = output_reduction
        ctx.full_shape = full.shape
        ctx.tile_sizes = [o.shape[output_unshard_dimension] if output_unshard_dimension else 1 for o in outs]
        if output_reduction == "mean":
            return full.mean()
        if output_reduction == "sum":
            return full.sum()
        return full

    @staticmethod
    def backward(ctx, grad):
        if ctx.reduction is None:
            full_grad = grad
        else:  # d(sum)/d(element) = 1, d(mean)/d(element) = 1/numel
            scale = 1.0 if ctx.reduction == "sum" else 1.0 / math.prod(ctx.full_shape)
            full_grad = (grad * scale).expand(ctx.full_shape)
        src = ctx.to_shard[ctx.key]
        needs = src.requires_grad
        src_grad = torch.zeros_like(src) if needs else None
        offset = 0
        for i in range(ctx.shards):
            _mark_ready(ctx.compute_params, i == ctx.shards - 1)
            tiles = {k: v[:, i * ctx.step:(i + 1) * ctx.step] for k, v in ctx.to_shard.items()}
            leaf = _leaf_like(tiles[ctx.key], needs)
            tiles[ctx.key] = leaf
            with torch.enable_grad():
                out = ctx.fn(**tiles, **ctx.to_pass)
            size = ctx.tile_sizes[i]
            if ctx.dim == 0:
                g = full_grad[i].reshape(out.shape)
            else:
                g = full_grad.narrow(ctx.dim, offset, size)
            offset += size
            slot = src_grad[:, i * ctx.step:(i + 1) * ctx.step] if needs else None
            if out.requires_grad:
                _backward_into(out, g, leaf, slot)
        _mark_ready(ctx.compute_params, True)
        grads = [None] * ctx.n_args
        grads[ctx.arg_index] = src_grad
        return (None,) * 9 + tuple(grads)


class TiledMLP(torch.autograd.Function):
    """``TiledMLP.apply(fn, self, x, shards, compute_params)``: ``fn(self, x_tile)`` over ``shards``
    tiles of ``x`` along dimension -2 (``[batch, seqlen, hidden]`` or ``[tokens, hidden]``).

    The MLP's ``[tokens, intermediate]`` activations exist for one tile at a time, in forward
    and in backward (which recomputes the tile).  ``compute_params``: the weights ``fn`` uses
    (only needed under ZeRO).  A Hugging Face MLP can be patched like this::

        def tiled_forward(self, x):
            shards = math.ceil(x.shape[-2] / x.shape[-1])   # all sequence-parallel ranks must agree
            params = [self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight]
            return TiledMLP.apply(type(self).__dict__["_untiled_forward"], self, x, shards, params)
    """

    @staticmethod
    def forward(ctx, fn, self, x, shards, compute_params):
        ctx.fn, ctx.module, ctx.shards = fn, self, shards
        ctx.compute_params = _trainable(compute_params)
        ctx.save_for_backward(x)
        with torch.no_grad():
            return torch.cat([fn(self, t) for t in torch.chunk(x, shards, dim=-2)], dim=-2)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        needs = ctx.needs_input_grad[2]
        x2 = x.detach().reshape(-1, x.shape[-1])  # batch and sequence as one row axis
        grad2 = grad.reshape(-1, x.shape[-1])
        x_grad = torch.zeros_like(x2) if needs else None
        rows = _row_ranges(x2.shape[0], ctx.shards)
        for i, (a, b) in enumerate(rows):
            _mark_ready(ctx.compute_params, i == len(rows) - 1)
            leaf = _leaf_like(x2[a:b], needs)
            with torch.enable_grad():
                out = ctx.fn(ctx.module, leaf)
            if out.requires_grad:
                _backward_into(out, grad2[a:b], leaf, x_grad[a:b] if needs else None)
        _mark_ready(ctx.compute_params, True)
        return None, None, (x_grad.view(x.shape) if needs else None), None, None


class TiledFusedLogitsLoss(torch.autograd.Function):
    """``TiledFusedLogitsLoss.apply(fn, self, x, y, mask, shards, compute_params, output_reduction)``:
    the loss ``fn(self, x_tile, y_tile[, mask_tile])`` over ``shards`` tiles of the flattened
    ``[batch * seqlen]`` rows of ``x`` (hidden states), ``y`` (labels) and ``mask`` (optional,
    ``[batch, seqlen]``), reduced by ``output_reduction`` (``"mean"`` of the tile losses, or
    ``"sum"``: use it, and divide yourself, when tiles hold different numbers of valid tokens).

    The logits exist for one tile at a time.  Each tile is backpropagated during forward (no
    recomputation); the input's and the parameters' gradients are kept aside and released to
    autograd in backward, scaled by the gradient that arrives for the loss.
    """

    @classmethod
    def apply(cls, fn, self, x, y, mask, shards, compute_params, output_reduction):
        if torch.is_grad_enabled():
            return super().apply(fn, self, x, y, mask, shards, compute_params, output_reduction)
        # evaluation: no gradients to prepare, just the tiles' losses
        cls._check(x, y, mask, output_reduction)
        x2, y2 = x.reshape(-1, *x.shape[2:]), y.reshape(-1, *y.shape[2:])
        m2 = mask.reshape(-1) if mask is not None else None
        losses = torch.stack([fn(self, x2[a:b], y2[a:b], *((m2[a:b],) if m2 is not None else ())).reshape(())
                              for a, b in _row_ranges(x2.shape[0], shards)])
        return losses.mean() if output_reduction == "mean" else losses.sum()

    @staticmethod
    def _check(x, y, mask, output_reduction):
        if output_reduction not in ("mean", "sum"):
            raise ValueError(f'TiledFusedLogitsLoss: unknown output_reduction {output_reduction!r}: valid values '
                             'are "mean" and "sum"')
        if x.dim() < 2 or y.dim() < 2:
            raise ValueError(f"TiledFusedLogitsLoss: x and y must be at least 2-D [batch, seqlen, ...], got "
                             f"x {tuple(x.shape)} and y {tuple(y.shape)}")
        if x.shape[:2] != y.shape[:2]:
            raise ValueError(f"TiledFusedLogitsLoss: x {tuple(x.shape)} and y {tuple(y.shape)} differ in "
                             "their batch/sequence dimensions")
        if mask is not None and tuple(mask.shape) != tuple(x.shape[:2]):
            raise ValueError(f"TiledFusedLogitsLoss: mask must be [batch, seqlen] = {tuple(x.shape[:2])}, "
                             f"got {tuple(mask.shape)}")

    @staticmethod
    def forward(ctx, fn, self, x, y, mask, shards, compute_params, output_reduction):
        TiledFusedLogitsLoss._check(x, y, mask, output_reduction)
        needs_x = ctx.needs_input_grad[2]
        params = _trainable(compute_params)
        if isinstance(self, torch.nn.Module):  # also any other trainable weight of the module fn is given
            seen = {id(p) for p in params}
            params += [p for p in self.parameters() if p.requires_grad and id(p) not in seen]
        x2 = x.detach().reshape(-1, *x.shape[2:])
        y2 = y.reshape(-1, *y.shape[2:])
        m2 = mask.reshape(-1) if mask is not None else None
        rows = _row_ranges(x2.shape[0], shards)
        per_tile = 1.0 / len(rows) if output_reduction == "mean" else 1.0  # d(mean of the tile losses)/d(tile)
        x_grad = torch.zeros_like(x2) if needs_x else None
        param_grads: list[torch.Tensor | None] = [None] * len(params)
        losses = []
        for a, b in rows:
            leaf = _leaf_like(x2[a:b], needs_x)
            args = (self, leaf, y2[a:b]) + ((m2[a:b],) if m2 is not None else ())
            with torch.enable_grad():
                loss = fn(*args)
            losses.append(loss.detach())
            inputs = ([leaf] if needs_x else []) + params
            if not inputs or not loss.requires_grad:
                continue
            got = torch.autograd.grad(loss, inputs, torch.full_like(loss, per_tile), allow_unused=True)
            if needs_x and got[0] is not None:
                x_grad[a:b].copy_(got[0])
            for k, g in enumerate(got[1:] if needs_x else got):
                if g is not None:
                    param_grads[k] = g if param_grads[k] is None else param_grads[k].add_(g)
        stacked = torch.stack([t.reshape(()) for t in losses])
        ctx.params = [p for p, g in zip(params, param_grads) if g is not None]
        ctx.param_grads = [g for g in param_grads if g is not None]
        ctx.x_shape = x.shape
        ctx.save_for_backward(x_grad if needs_x else None)
        return stacked.mean() if output_reduction == "mean" else stacked.sum()

    @staticmethod
    def backward(ctx, grad):
        (x_grad,) = ctx.saved_tensors
        if ctx.params:  # hand the parameters' gradients to autograd now, so hooks (ZeRO) see them in backward
            gather_for_gradients(ctx.params)  # (ZeRO-3: whole again, as for a module's backward)
            torch.autograd.backward(ctx.params, [g.mul_(grad.to(g.dtype)) for g in ctx.param_grads])
            ctx.params, ctx.param_grads = [], []
        if x_grad is not None:
            x_grad = (x_grad * grad.to(x_grad.dtype)).view(ctx.x_shape)
        return None, None, x_grad, None, None, None, None, None
