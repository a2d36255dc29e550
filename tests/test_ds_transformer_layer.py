"""DeepSpeed's fused transformer layer (``DeepSpeedTransformerLayer``) as a PyTorch module
(shardwise.models.transformer_layer): its documented math computed by hand, its parameter names, its
config, dropout placement, and training through the engine."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shardwise.models.transformer_layer import TransformerLayer, TransformerLayerConfig

REPO = Path(__file__).resolve().parents[1]
DS_PARAMS = ["attn_qkvw", "attn_qkvb", "attn_ow", "attn_ob", "attn_nw", "attn_nb", "inter_w", "inter_b", "output_w",
             "output_b", "norm_w", "norm_b"]


def _config(**over):
    base = dict(batch_size=2, hidden_size=8, intermediate_size=16, heads=2, attn_dropout_ratio=0.0,
                hidden_dropout_ratio=0.0, num_hidden_layers=2, initializer_range=0.5, layer_norm_eps=1e-5)
    base.update(over)
    return TransformerLayerConfig(**base)


def _ln(x, w, b, eps):
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + eps) * w + b


def _gelu(x):
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


def _by_hand(p, x, mask, heads, eps, pre_ln):
    """DeepSpeed's kernel sequence (csrc/transformer/ds_transformer_cuda.cpp, BertTransformerLayer::Forward),
    written out with plain tensor arithmetic, one batch row and one head at a time."""
    bsz, seq, hid = x.shape
    d = hid // heads
    out = torch.empty_like(x)
    for b in range(bsz):
        xb = x[b]
        y = _ln(xb, p["norm_w"], p["norm_b"], eps) if pre_ln else xb
        qkv = y @ p["attn_qkvw"].T + p["attn_qkvb"]
        q, k, v = qkv[:, :hid], qkv[:, hid:2 * hid], qkv[:, 2 * hid:]
        ctx = torch.empty(seq, hid, dtype=x.dtype)
        for h in range(heads):
            sl = slice(h * d, (h + 1) * d)
            scores = q[:, sl] @ k[:, sl].T / math.sqrt(d) + mask[b, 0]
            e = torch.exp(scores - scores.max(-1, keepdim=True).values)
            ctx[:, sl] = (e / e.sum(-1, keepdim=True)) @ v[:, sl]
        attn_out = ctx @ p["attn_ow"].T + p["attn_ob"]
        if pre_ln:
            a = xb + attn_out
            ff = _gelu(_ln(a, p["attn_nw"], p["attn_nb"], eps) @ p["inter_w"].T + p["inter_b"])
            out[b] = a + ff @ p["output_w"].T + p["output_b"]
        else:
            a = _ln(xb + attn_out, p["attn_nw"], p["attn_nb"], eps)
            ff = _gelu(a @ p["inter_w"].T + p["inter_b"])
            out[b] = _ln(a + ff @ p["output_w"].T + p["output_b"], p["norm_w"], p["norm_b"], eps)
    return out


@pytest.mark.parametrize("pre_ln", [True, False])
def test_layer_equals_deepspeeds_formula_by_hand(pre_ln):
    torch.manual_seed(0)
    layer = TransformerLayer(_config(pre_layer_norm=pre_ln)).double()
    with torch.no_grad():  # non-trivial norms and biases, so every parameter's role is checked
        for name in ("attn_qkvb", "attn_ob", "attn_nw", "attn_nb", "inter_b", "output_b", "norm_w", "norm_b"):
            getattr(layer, name).copy_(torch.randn_like(getattr(layer, name)))
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    mask = torch.zeros(2, 1, 1, 5, dtype=torch.float64)
    mask[1, ..., 3:] = -10000.0  # DeepSpeed's convention: additive, padding keys of sample 1 masked
    params = {n: getattr(layer, n).detach() for n in DS_PARAMS}
    expected = _by_hand(params, x, mask, heads=2, eps=1e-5, pre_ln=pre_ln)
    for mode in (layer.train, layer.eval):  # no dropout configured: train and eval agree
        mode()
        torch.testing.assert_close(layer(x, mask), expected, rtol=1e-10, atol=1e-10)
    # the mask matters: masked keys change nothing for sample 1 when their values change
    x2 = x.clone()
    x2[1, 3:] += 5.0
    if pre_ln:  # rows 0-2 of sample 1 only read rows 3-4 through attention, which is masked
        torch.testing.assert_close(layer(x2, mask)[1, :3], expected[1, :3], rtol=1e-10, atol=1e-10)


def test_parameters_state_dict_and_init_follow_deepspeed():
    TransformerLayer.layer_id = 0
    cfg = _config(hidden_size=16, intermediate_size=-1, heads=4, initializer_range=0.02, num_hidden_layers=8,
                  local_rank=0)
    layer = TransformerLayer(cfg)
    assert list(layer.state_dict()) == DS_PARAMS
    assert cfg.intermediate_size == 64 and cfg.layer_id == 0
    shapes = {n: tuple(t.shape) for n, t in layer.state_dict().items()}
    assert shapes == {"attn_qkvw": (48, 16), "attn_qkvb": (48,), "attn_ow": (16, 16), "attn_ob": (16,),
                      "attn_nw": (16,), "attn_nb": (16,), "inter_w": (64, 16), "inter_b": (64,), "output_w": (16, 64),
                      "output_b": (16,), "norm_w": (16,), "norm_b": (16,)}
    assert torch.equal(layer.norm_w, torch.ones(16)) and torch.equal(layer.attn_qkvb, torch.zeros(48))
    # adjust_init_range with local_rank 0: output projections use initializer_range / sqrt(2 * layers)
    assert abs(layer.attn_ow.std().item() - 0.02 / 4) < 0.002 and abs(layer.inter_w.std().item() - 0.02) < 0.004
    second = TransformerLayer(_config())
    assert second.config.layer_id == 1
    tup = TransformerLayer(_config(return_tuple=True))
    out = tup(torch.randn(1, 3, 8), torch.zeros(1, 1, 1, 3))
    assert isinstance(out, tuple) and len(out) == 1 and out[0].shape == (1, 3, 8)
    # DeepSpeed's test path: given q, k, v, ... weights and biases
    w = [torch.nn.Parameter(torch.randn(s)) for s in [(8, 8)] * 4 + [(8,), (16, 8), (8, 16), (8,)]]
    bias = [torch.nn.Parameter(torch.randn(s)) for s in [(8,)] * 4 + [(8,), (16,), (8,), (8,)]]
    given = TransformerLayer(_config(), initial_weights=w, initial_biases=bias)
    assert torch.equal(given.attn_qkvw, torch.cat([w[0], w[1], w[2]])) and given.inter_w is w[5]
    with pytest.raises(ValueError, match="multiple of heads"):
        TransformerLayer(_config(heads=3))


def test_config_from_dict_and_json(tmp_path):
    cfg = TransformerLayerConfig.from_dict({"hidden_size": 32, "heads": 4, "pre_layer_norm": False})
    assert (cfg.hidden_size, cfg.heads, cfg.pre_layer_norm, cfg.layer_norm_eps) == (32, 4, False, 1e-12)
    for enc in ("utf-16", "utf-8"):
        path = tmp_path / f"{enc}.json"
        path.write_text(json.dumps({"hidden_size": 16, "attn_dropout_ratio": 0.1}), encoding=enc)
        got = TransformerLayerConfig.from_json_file(str(path))
        assert (got.hidden_size, got.attn_dropout_ratio) == (16, 0.1)


def test_dropout_sites():
    torch.manual_seed(1)
    x = torch.randn(2, 4, 8)
    # attention-probability dropout of 1 empties the attention: pre-LN gives x + attn_ob then the MLP
    layer = TransformerLayer(_config(attn_dropout_ratio=1.0))
    with torch.no_grad():
        layer.attn_ob.copy_(torch.randn(8))
    a = x + layer.attn_ob
    ff = _gelu(_ln(a, layer.attn_nw, layer.attn_nb, 1e-5) @ layer.inter_w.T + layer.inter_b)
    torch.testing.assert_close(layer(x), a + ff @ layer.output_w.T + layer.output_b)
    layer.eval()  # no dropout in eval
    assert not torch.allclose(layer(x), a + ff @ layer.output_w.T + layer.output_b)
    # hidden dropout of 1 drops both residual branches: pre-LN is the identity, post-LN two norms
    pre = TransformerLayer(_config(hidden_dropout_ratio=1.0))
    torch.testing.assert_close(pre(x), x)
    post = TransformerLayer(_config(hidden_dropout_ratio=1.0, pre_layer_norm=False))
    ln1 = _ln(x, post.attn_nw, post.attn_nb, 1e-5)
    torch.testing.assert_close(post(x), _ln(ln1, post.norm_w, post.norm_b, 1e-5))
    # 0 < p < 1: training is random, draws from torch's generator (so seeding repeats it)
    mid = TransformerLayer(_config(attn_dropout_ratio=0.3, hidden_dropout_ratio=0.3))
    torch.manual_seed(5)
    first = mid(x)
    torch.manual_seed(5)
    assert torch.equal(mid(x), first) and not torch.equal(mid(x), first)


def test_scripts_that_build_it_train():
    """A BERT-like stack of the layer trains under shardwise.initialize (DeepSpeedExamples' bing_bert builds
    its encoder from DeepSpeedTransformerLayer), and the gradient hook list DeepSpeed's tests use fills."""
    import shardwise

    torch.manual_seed(0)

    class Encoder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            cfg = dict(batch_size=4, hidden_size=16, heads=4, attn_dropout_ratio=0.1, hidden_dropout_ratio=0.1,
                       num_hidden_layers=2, initializer_range=0.1)
            self.embed = torch.nn.Embedding(11, 16)
            self.layers = torch.nn.ModuleList(TransformerLayer(TransformerLayerConfig(**cfg)) for _ in range(2))
            self.head = torch.nn.Linear(16, 11)

        def forward(self, ids, labels):
            mask = torch.zeros(ids.shape[0], 1, 1, ids.shape[1])
            h = self.embed(ids)
            for layer in self.layers:
                h = layer(h, mask)
            return torch.nn.functional.cross_entropy(self.head(h).flatten(0, 1), labels.flatten())

    engine, *_ = shardwise.initialize(model=Encoder(), config={
        "train_batch_size": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}})
    ids = torch.randint(0, 11, (4, 6))
    losses = []
    for _ in range(20):
        loss = engine(ids, (ids + 1) % 11)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses
    grads = []
    layer = TransformerLayer(_config())
    layer(torch.randn(1, 3, 8), torch.zeros(1, 1, 1, 3), grads=grads).sum().backward()
    assert {tag for _, tag in grads} == {"V_W", "V_B", "O_W", "O_B", "N2_W", "N2_B", "int_W", "int_B", "out_W",
                                        "out_B", "norm_W", "norm_B"}


_PROBE = r"""
import torch
from deepspeed.ops.transformer import (DeepSpeedTransformerConfig, DeepSpeedTransformerLayer,
                                       DeepSpeedTransformerInference)
from shardwise.models.transformer_layer import TransformerLayer
assert DeepSpeedTransformerLayer is TransformerLayer
cfg = DeepSpeedTransformerConfig(batch_size=2, hidden_size=8, heads=2, attn_dropout_ratio=0.0,
                                 hidden_dropout_ratio=0.0, num_hidden_layers=1, initializer_range=0.02,
                                 local_rank=-1, seed=1234, fp16=False, pre_layer_norm=True)
layer = DeepSpeedTransformerLayer(cfg)
assert layer(torch.randn(2, 3, 8), torch.zeros(2, 1, 1, 3)).shape == (2, 3, 8)
try:
    DeepSpeedTransformerInference()
    raise SystemExit("kernel layer built")
except NotImplementedError as e:
    assert "not provided by shardwise" in str(e)
print("ok")
"""


def test_deepspeed_paths():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "compat" / "deepspeed"), str(REPO)])}
    out = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]
