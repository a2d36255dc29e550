"""Tiled MLP / logits+loss / generic tiled compute (runtime/sequence_parallel/tiled.py): same values
and gradients as the untiled computation, a lower memory peak, and ZeRO 1-3 training parity."""

from __future__ import annotations

import weakref

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from shardwise.runtime.sequence_parallel.tiled import (SequenceTiledCompute, TiledFusedLogitsLoss, TiledMLP,
                                                       sequence_tiled_compute)

TIGHT = {"rtol": 1e-5, "atol": 1e-5}  # fp32; tiles only change the summation order (gradients are O(1-10))


class MemoryTracker(TorchDispatchMode):
    """Bytes of every tensor storage created by an operator while active: ``largest`` single
    allocation and ``peak`` of the sum alive at once (a storage counts until it is freed)."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = self.largest = 0
        self._seen: set[int] = set()

    def _freed(self, key: int, n: int) -> None:
        self.live -= n
        self._seen.discard(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                s = t.untyped_storage()
                if id(s) in self._seen:
                    continue
                n = s.nbytes()
                self._seen.add(id(s))
                self.live += n
                self.largest = max(self.largest, n)
                self.peak = max(self.peak, self.live)
                weakref.finalize(s, self._freed, id(s), n)
        return out


class LlamaMLP(nn.Module):
    def __init__(self, hidden=32, inter=128):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def mlp_fn(self, x):
    return LlamaMLP.forward(self, x)


def _grads(*tensors):
    return [t.grad.clone() for t in tensors]


def _mlp_case(shards, shape, seed=0):
    torch.manual_seed(seed)
    mlp = LlamaMLP()
    x = torch.randn(*shape, 32)
    g = torch.randn(*shape, 32)
    x1 = x.clone().requires_grad_()
    mlp(x1).backward(g)
    ref_out, ref = mlp(x).detach(), _grads(x1, *mlp.parameters())
    mlp.zero_grad()
    x2 = x.clone().requires_grad_()
    out = TiledMLP.apply(mlp_fn, mlp, x2, shards, list(mlp.parameters()))
    out.backward(g)
    return ref_out, ref, out.detach(), _grads(x2, *mlp.parameters())


@pytest.mark.parametrize("shards,shape", [(8, (2, 256)), (5, (1, 203)), (3, (50,))])
def test_tiled_mlp_equals_untiled(shards, shape):
    ref_out, ref, out, got = _mlp_case(shards, shape)
    torch.testing.assert_close(out, ref_out, **TIGHT)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, **TIGHT)


def test_tiled_mlp_lowers_peak_memory():
    torch.manual_seed(0)
    mlp = LlamaMLP(hidden=32, inter=256)
    x = torch.randn(1, 2048, 32)

    def run(tiled):
        xi = x.clone().requires_grad_()
        mlp.zero_grad(set_to_none=True)
        with MemoryTracker() as m:
            out = TiledMLP.apply(mlp_fn, mlp, xi, 16, list(mlp.parameters())) if tiled else mlp(xi)
            out.sum().backward()
        return m

    full, tiled = run(False), run(True)
    inter = 2048 * 256 * 4  # one [tokens, intermediate] fp32 activation
    assert full.largest >= inter
    assert tiled.largest < inter / 4, (tiled.largest, inter)
    assert tiled.peak < full.peak / 3, (tiled.peak, full.peak)


class Head(nn.Module):
    def __init__(self, hidden=32, vocab=1000):
        super().__init__()
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        self.vocab = vocab


def loss_fn(self, x, y, mask=None):
    logits = self.lm_head(x).float()
    if mask is None:
        return F.cross_entropy(logits.view(-1, self.vocab), y.view(-1), ignore_index=-100, reduction="sum")
    per_token = F.cross_entropy(logits.view(-1, self.vocab), y.view(-1), reduction="none")
    return (per_token * mask.view(-1)).sum()


def _loss_case(shards, *, mask, reduction, scale, seqlen=256):
    torch.manual_seed(1)
    head = Head()
    x = torch.randn(2, seqlen, 32)
    y = torch.randint(0, 1000, (2, seqlen))
    y[0, :7] = -100
    m = (torch.rand(2, seqlen) > 0.3).float() if mask else None
    x1 = x.clone().requires_grad_()
    ref_loss = loss_fn(head, x1, y, m)
    if reduction == "mean":  # the mean of the tile losses, computed whole
        n_tiles = len(torch.chunk(torch.arange(2 * seqlen), shards))
        ref_loss = ref_loss / n_tiles
    (ref_loss * scale).backward()
    ref = _grads(x1, head.lm_head.weight)
    head.zero_grad()
    x2 = x.clone().requires_grad_()
    loss = TiledFusedLogitsLoss.apply(loss_fn, head, x2, y, m, shards, [head.lm_head.weight], reduction)
    (loss * scale).backward()
    return ref_loss.detach(), ref, loss.detach(), _grads(x2, head.lm_head.weight)


@pytest.mark.parametrize("shards,mask,reduction,scale",
                         [(4, False, "sum", 1.0), (7, True, "sum", 0.25), (4, False, "mean", 1.0),
                          (3, True, "mean", 3.0)])
def test_tiled_logits_loss_equals_untiled(shards, mask, reduction, scale):
    # scale != 1: the loss is divided by gradient accumulation steps or multiplied by a loss scale
    # after the tiled function returned; the weight's gradient must follow (DeepSpeed's does not)
    ref_loss, ref, loss, got = _loss_case(shards, mask=mask, reduction=reduction, scale=scale)
    if reduction == "sum":
        torch.testing.assert_close(loss, ref_loss, **TIGHT)
    else:  # the mean of per-tile sums is not the sum / tiles of the whole only up to rounding
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-4)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, **TIGHT)


def test_tiled_logits_loss_lowers_peak_memory_and_checks_shapes():
    torch.manual_seed(0)
    head = Head(hidden=32, vocab=2000)
    x = torch.randn(1, 1024, 32)
    y = torch.randint(0, 2000, (1, 1024))

    def run(tiled):
        xi = x.clone().requires_grad_()
        head.zero_grad(set_to_none=True)
        with MemoryTracker() as m:
            if tiled:
                loss = TiledFusedLogitsLoss.apply(loss_fn, head, xi, y, None, 16, [head.lm_head.weight], "sum")
            else:
                loss = loss_fn(head, xi, y)
            loss.backward()
        return m

    full, tiled = run(False), run(True)
    logits = 1024 * 2000 * 4
    assert full.largest >= logits
    assert tiled.largest < logits / 4, (tiled.largest, logits)
    assert tiled.peak < full.peak / 3, (tiled.peak, full.peak)
    head.zero_grad(set_to_none=True)
    with torch.no_grad():  # evaluation: the same loss, no gradient work
        loss = TiledFusedLogitsLoss.apply(loss_fn, head, x.requires_grad_(), y, None, 16, [head.lm_head.weight], "sum")
        torch.testing.assert_close(loss, loss_fn(head, x, y), **TIGHT)
    assert head.lm_head.weight.grad is None and x.grad is None
    with pytest.raises(ValueError, match="output_reduction"):
        TiledFusedLogitsLoss.apply(loss_fn, head, x, y, None, 2, [], "max")
    with pytest.raises(ValueError, match="mask must be"):
        TiledFusedLogitsLoss.apply(loss_fn, head, x, y, torch.ones(1, 5), 2, [], "sum")


@pytest.mark.parametrize("seqlen,shards", [(96, 4), (97, 5)])
def test_sequence_tiled_compute_mlp_and_loss(seqlen, shards):
    torch.manual_seed(2)
    mlp, head = LlamaMLP(), Head(vocab=50)
    x = torch.randn(2, seqlen, 32)
    y = torch.randint(0, 50, (2, seqlen))
    g = torch.randn(2, seqlen, 32)

    def mlp_kw(hidden_states):
        return mlp(hidden_states)

    def loss_kw(hidden_states, labels, vocab):
        return F.cross_entropy(head.lm_head(hidden_states).reshape(-1, vocab), labels.reshape(-1), reduction="sum")

    params = list(mlp.parameters()) + [head.lm_head.weight]
    # 1. an MLP: output unsharded along the sequence, no reduction
    x1 = x.clone().requires_grad_()
    mlp(x1).backward(g)
    ref = _grads(x1, *mlp.parameters())
    mlp.zero_grad()
    x2 = x.clone().requires_grad_()
    out = sequence_tiled_compute(mlp_kw, seqlen, shards, {"hidden_states": x2}, {}, "hidden_states",
                                 compute_params=params, output_unshard_dimension=1, output_reduction=None)
    torch.testing.assert_close(out, mlp(x).detach(), **TIGHT)
    out.backward(g)
    for a, b in zip(_grads(x2, *mlp.parameters()), ref):
        torch.testing.assert_close(a, b, **TIGHT)
    assert all(p.ds_grad_is_ready for p in params)
    # 2. a loss: one scalar per tile, stacked (dimension 0) and summed or averaged
    step = -(-seqlen // shards)
    n_tiles = shards  # DeepSpeed's tiling: `shards` slices of ceil(seqlen / shards), the last maybe short
    for reduction, denom in (("sum", 1.0), ("mean", float(n_tiles))):
        x1 = x.clone().requires_grad_()
        ref_loss = loss_kw(x1, y, 50) / denom
        (2.0 * ref_loss).backward()
        ref = _grads(x1, head.lm_head.weight)
        head.zero_grad()
        x2 = x.clone().requires_grad_()
        loss = SequenceTiledCompute.apply(loss_kw, seqlen, shards, ["hidden_states", "labels"], ["vocab"],
                                          "hidden_states", [head.lm_head.weight], 0, reduction, x2, y, 50)
        torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-5, atol=1e-4)
        (2.0 * loss).backward()
        for a, b in zip(_grads(x2, head.lm_head.weight), ref):
            torch.testing.assert_close(a, b, **TIGHT)
        head.zero_grad()
    assert step * (shards - 1) < seqlen
    with pytest.raises(ValueError, match="grad_requiring_tensor_key"):
        sequence_tiled_compute(mlp_kw, seqlen, shards, {"hidden_states": x}, {}, "x")


# -- ZeRO 1-3 at 2 ranks: the tiles' gradients are reduced once, after the last tile ------------
class TinyLM(nn.Module):
    def __init__(self, vocab=40, hidden=16, inter=48, shards=0):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.mlp = LlamaMLP(hidden, inter)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        self.vocab, self.shards = vocab, shards

    def forward(self, ids, labels):
        h = self.embed(ids)
        m = self.mlp
        if self.shards:
            h = h + TiledMLP.apply(mlp_fn, m, h, self.shards, [m.gate_proj.weight, m.up_proj.weight,
                                                               m.down_proj.weight])
            total = TiledFusedLogitsLoss.apply(_lm_loss, self, h, labels, None, self.shards,
                                               [self.lm_head.weight], "sum")
        else:
            h = h + m(h)
            total = _lm_loss(self, h, labels)
        return total / labels.numel()


def _lm_loss(self, x, y):
    return F.cross_entropy(self.lm_head(x).reshape(-1, self.vocab), y.reshape(-1), reduction="sum")


def _zero_body(stage, rank, world):
    import shardwise

    zero = {"stage": stage, "reduce_bucket_size": 300}
    if stage == 3:
        zero.update(stage3_param_persistence_threshold=0, stage3_prefetch_bucket_size=100)
    losses = {}
    for shards in (0, 3):
        torch.manual_seed(0)
        model = TinyLM(shards=shards)
        cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
               "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "zero_optimization": zero}
        engine, *_ = shardwise.initialize(model=model, config=cfg)
        g = torch.Generator().manual_seed(5)
        run = []
        for _ in range(3):
            for _ in range(2):
                ids = torch.randint(0, 40, (2 * world, 20), generator=g)[rank * 2:(rank + 1) * 2]
                loss = engine(ids, torch.roll(ids, -1, 1))
                engine.backward(loss)
                if stage == 3:  # (no parameter is persistent): everything partitioned again after backward
                    whole = [n for n, p in model.named_parameters() if p.numel()]
                    assert not whole, f"gathered after backward: {whole}"
                engine.step()
                run.append(loss.item())
        losses[shards] = run
    return losses


def _zero_cases(rank, world):
    from distributed import run_subtests

    return run_subtests(_zero_body, [1, 2, 3], rank, world)


def test_tiled_training_under_zero_matches_untiled():
    from distributed import run_distributed

    results = run_distributed(_zero_cases, 2, timeout=120)
    for stage, per_stage in zip([1, 2, 3], results[0]):
        torch.testing.assert_close(torch.tensor(per_stage[3]), torch.tensor(per_stage[0]), rtol=1e-5, atol=0,
                                   msg=f"stage {stage}")
