"""Muon (``"optimizer": {"type": "Muon"}``): DeepSpeed's parameter split and the whole-matrix update at ZeRO 0-3."""

from __future__ import annotations

import pytest
import torch

from models import base_config, make_data, make_model, mse, zero_fill_grads

MUON = {"type": "Muon", "params": {"lr": 0.02, "adam_lr": 1e-2, "weight_decay": 0.01, "momentum": 0.9,
                                   "ns_dtype": "fp32"}}
STEPS, MICRO = 2, 4


class Gpt(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(11, 8)
        self.proj = torch.nn.Linear(8, 8)
        self.norm = torch.nn.LayerNorm(8)
        self.lm_head = torch.nn.Linear(8, 11, bias=False)


def test_split_follows_deepspeed_and_honours_use_muon():
    import shardwise
    from shardwise.optim.muon import tag_muon_params

    model = Gpt()
    model.norm.weight.use_muon = True  # the user's own choice wins (DeepSpeed overwrites it)
    with pytest.raises(ValueError, match=r"shape \(8,\) has use_muon set"):
        shardwise.initialize(model=model, config=base_config(optimizer=MUON))
    model = Gpt()
    tag_muon_params(model)
    assert {n for n, p in model.named_parameters() if p.use_muon} == {"proj.weight"}
    engine, _, _, _ = shardwise.initialize(model=Gpt(), config=base_config(optimizer=MUON))
    groups = {g["name"]: g for g in engine.optimizer.param_groups}
    assert set(groups) == {"muon-params", "adam-params"}
    assert groups["muon-params"]["lr"] == 0.02 and groups["adam-params"]["lr"] == 1e-2
    assert groups["adam-params"]["betas"] == (0.9, 0.95) and groups["adam-params"]["eps"] == 1e-10  # DeepSpeed's


def test_orthogonalize_gram_equals_standard_and_matches_torch_muon():
    from shardwise.optim.muon import Muon, orthogonalize

    g = torch.Generator().manual_seed(0)
    for shape in [(16, 48), (48, 16), (24, 24)]:
        u = torch.randn(*shape, generator=g, dtype=torch.float64)
        gram, std = orthogonalize(u, method="gram", dtype=torch.float64), orthogonalize(u, method="standard",
                                                                                        dtype=torch.float64)
        torch.testing.assert_close(gram, std, rtol=1e-9, atol=1e-9)  # same iteration, other association
        s = torch.linalg.svdvals(gram / (max(shape[0] / shape[1], 1.0) ** 0.5))
        assert 0.5 < s.min() and s.max() < 1.3, s  # NS5 pushes every singular value near 1
    # one step against torch.optim.Muon (Newton-Schulz in bf16 in both, DeepSpeed's 'standard' method)
    w = torch.randn(32, 16, generator=g)
    grad = torch.randn(32, 16, generator=g)
    mine, theirs = torch.nn.Parameter(w.clone()), torch.nn.Parameter(w.clone())
    mine.grad, theirs.grad = grad.clone(), grad.clone()
    Muon([{"params": [mine], "use_muon": True, "lr": 0.02, "weight_decay": 0.1, "momentum": 0.95,
           "ns_method": "standard"}], ns_dtype=torch.bfloat16).step()
    torch.optim.Muon([theirs], lr=0.02, weight_decay=0.1, momentum=0.95).step()
    torch.testing.assert_close(mine.detach(), theirs.detach(), rtol=0, atol=2e-3)  # bf16 rounding of the step
    assert (mine - w).abs().max() > 0.01


def _one_process():
    from shardwise.optim.muon import Muon, muon_param_groups, tag_muon_params

    model = make_model()
    tag_muon_params(model)
    params = {k: v for k, v in MUON["params"].items() if k != "ns_dtype"}
    opt = Muon(muon_param_groups(model.parameters(), params), ns_dtype=torch.float32)
    x, y = make_data(STEPS, 2 * MICRO)
    for s in range(STEPS):
        opt.zero_grad()
        mse(model(x[s]), y[s]).backward()
        zero_fill_grads(model)
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _zero_body(rank: int, world: int):
    import shardwise

    out = {}
    for stage in (0, 1, 2, 3):
        cfg = base_config(optimizer=MUON, train_micro_batch_size_per_gpu=MICRO,
                          zero_optimization={"stage": stage, "reduce_bucket_size": 40})
        engine, _, _, _ = shardwise.initialize(model=make_model(), config=cfg)
        x, y = make_data(STEPS, world * MICRO)
        for s in range(STEPS):
            engine.backward(mse(engine(x[s, rank * MICRO:(rank + 1) * MICRO]), y[s, rank * MICRO:(rank + 1) * MICRO]))
            engine.step()
        out[stage] = {n: t.detach().clone() for n, t in engine.module_state_dict().items()}
    return out


def test_muon_at_zero_0_to_3_matches_one_process_muon():
    """2 ranks, ZeRO 0-3, fp32: the same weights as one process's Muon on the whole batch."""
    from distributed import run_distributed

    want = _one_process()
    start = {n: p.detach() for n, p in make_model().named_parameters()}
    results = run_distributed(_zero_body, 2, timeout=240)
    for stage in (0, 1, 2, 3):
        for name, w in want.items():
            assert not torch.equal(w, start[name]) or name == "frozen", name
            for rank in (0, 1):
                torch.testing.assert_close(results[rank][stage][name], w, rtol=1e-5, atol=1e-6,
                                           msg=lambda m: f"stage {stage} rank {rank} {name}: {m}")
