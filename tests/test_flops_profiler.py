"""Flops profiler: FLOPs equal the analytic count for Linear, MLP, attention and the demo GPT;
top-module ordering; the engine's profile of a real step (forward, backward) on rank 0."""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from distributed import run_distributed, run_subtests
from models import base_config, make_data, make_model, mse

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class SDPAttention(nn.Module):
    def __init__(self, c: int, heads: int, manual: bool = False) -> None:
        super().__init__()
        self.heads, self.manual = heads, manual
        self.qkv = nn.Linear(c, 3 * c)
        self.proj = nn.Linear(c, c)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in self.qkv(x).split(c, dim=2))
        if self.manual:
            att = torch.softmax(q @ k.transpose(-1, -2) / (c // self.heads) ** 0.5, dim=-1)
            y = att @ v
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


def test_linear_and_mlp_flops_equal_the_analytic_count():
    from shardwise.profiling import get_model_profile

    b, i, h, o = 5, 12, 40, 3
    flops, macs, params = get_model_profile(nn.Linear(i, o), input_shape=(b, i), print_profile=False,
                                            as_string=False)
    assert flops == 2 * b * i * o and macs == b * i * o and params == i * o + o
    mlp = nn.Sequential(nn.Linear(i, h), nn.GELU(), nn.Linear(h, o))
    flops, macs, params = get_model_profile(mlp, input_shape=(b, i), print_profile=False, as_string=False)
    assert flops == 2 * b * (i * h + h * o)
    assert params == i * h + h + h * o + o
    assert get_model_profile(mlp, input_shape=(b, i), print_profile=False) == (
        f"{2 * b * (i * h + h * o) / 1e3:.2f} KFLOPs", f"{b * (i * h + h * o) / 1e3:.2f} KMACs", str(i * h + h + h * o + o))


@pytest.mark.parametrize("manual", [False, True], ids=["sdpa", "matmul-softmax"])
def test_attention_flops_equal_the_analytic_count(manual):
    from shardwise.profiling import get_model_profile

    b, t, c, heads = 2, 16, 32, 4
    flops, _, _ = get_model_profile(SDPAttention(c, heads, manual), input_shape=(b, t, c), print_profile=False,
                                    as_string=False)
    n = b * t
    # qkv and output projections + (q @ k^T) and (att @ v), each 2 * b * t * t * c
    assert flops == 2 * n * c * 3 * c + 2 * n * c * c + 4 * b * t * t * c


def test_demo_gpt_flops_and_top_module_ordering(tmp_path):
    sys.path.insert(0, os.path.join(ROOT, "examples", "gpt"))
    try:
        from model import GPT, GPTConfig
    finally:
        sys.path.pop(0)
    from shardwise.profiling import FlopsProfiler, get_model_profile

    cfg = GPTConfig(n_layer=2, n_embd=32, n_head=4, block_size=16, vocab_size=50)
    model = GPT(cfg)
    b, t, c, v, n = 3, 16, 32, 50, 3 * 16
    idx = torch.randint(0, v, (b, t))
    out = tmp_path / "profile.txt"
    flops, _, params = get_model_profile(model, args=[idx], as_string=False, output_file=str(out), top_modules=3)
    per_block = 2 * n * c * 3 * c + 2 * n * c * c + 4 * b * t * t * c + 2 * (2 * n * c * 4 * c)
    assert flops == cfg.n_layer * per_block + 2 * n * c * v
    assert params == sum(p.numel() for p in model.parameters())
    text = out.read_text()
    assert "forward FLOPs" in text and "blocks.1 (Block)" in text and "top 3 modules at each depth" in text

    # top modules: children of different, known cost
    wide = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 64), nn.Linear(64, 4))
    prof = FlopsProfiler(wide)
    prof.start_profile()
    wide(torch.randn(2, 8))
    prof.stop_profile()
    by_flops = [s.name for s in prof.top_modules(1, 3, "flops")]
    assert by_flops == ["1", "2", "0"]  # 16*64 > 64*4 > 8*16
    assert [s.name for s in prof.top_modules(1, 2, "params")] == ["1", "2"]
    assert [s.flops for s in prof.top_modules(1, 3, "flops")] == [2 * 2 * 16 * 64, 2 * 2 * 64 * 4, 2 * 2 * 8 * 16]
    assert prof.stats[""].flops == sum(s.flops for s in prof.top_modules(1, 3))


def test_get_model_profile_argument_errors():
    from shardwise.profiling import get_model_profile

    with pytest.raises(ValueError, match="give input_shape"):
        get_model_profile(nn.Linear(2, 2), print_profile=False)
    with pytest.raises(ValueError, match="not both"):
        get_model_profile(nn.Linear(2, 2), input_shape=(1, 2), args=[torch.ones(1, 2)], print_profile=False)
    with pytest.raises(ValueError, match="positive ints"):
        get_model_profile(nn.Linear(2, 2), input_shape=(1, 0), print_profile=False)


def _profiled_run(stage: int, rank: int, world: int, out_dir: str):
    import shardwise

    out_file = os.path.join(out_dir, f"flops-z{stage}.txt")
    cfg = base_config(gradient_accumulation_steps=2, zero_optimization={"stage": stage, "reduce_bucket_size": 64},
                      flops_profiler={"enabled": True, "profile_step": 1, "output_file": out_file, "top_modules": 2})
    engine, *_ = shardwise.initialize(model=make_model(), config=cfg)
    x, y = make_data(6, 4 * world)
    for s in range(6):  # 3 optimizer steps; step index 1 is profiled
        xs, ys = x[s, rank * 4:(rank + 1) * 4], y[s, rank * 4:(rank + 1) * 4]
        engine.backward(mse(engine(xs), ys))
        engine.step()
    prof = engine.observer.last_flops_profile
    if prof is None:
        return None
    return {"forward": prof.forward_flops, "backward": prof.backward_flops, "other": prof.other_flops,
            "calls": prof.stats[""].calls, "fc2": prof.stats["fc2"].flops, "params": prof.get_total_params(),
            "text": open(out_file).read()}


def _profiled_body(rank: int, world: int, out_dir: str, stages: list[int]):
    return run_subtests(_profiled_run, stages, rank, world, out_dir)


def _stages_to_profile() -> list[int]:
    """Stage 0, and stage 3 (partitioned parameters) once the config accepts it."""
    from shardwise.config import ConfigError, load_config

    try:
        load_config({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}).check_supported()
        return [0, 3]
    except ConfigError:
        return [0]


def test_engine_profiles_the_configured_step_on_rank0(tmp_path):
    stages = _stages_to_profile()
    r0, r1 = run_distributed(_profiled_body, 2, args=(str(tmp_path), stages), timeout=120)
    assert r1 == [None] * len(stages)  # only rank 0 profiles
    batch, d_in, hidden, d_out = 4, 7, 13, 3
    fwd = 2 * batch * (d_in * hidden + hidden * hidden + hidden * d_out)
    # backward: grad-of-weight for every Linear, grad-of-input for all but the first (x needs no grad)
    bwd = 2 * batch * (d_in * hidden + 2 * hidden * hidden + 2 * hidden * d_out)
    n_params = sum(p.numel() for p in make_model().parameters())
    for stage, result in zip(stages, r0):
        text = result.pop("text")
        assert result == {"forward": 2 * fwd, "backward": 2 * bwd, "other": 0, "calls": 2,
                          "fc2": 2 * 2 * batch * hidden * hidden, "params": n_params}, f"stage {stage}"
        assert "shardwise flops profiler: step 1" in text and "fc2 (Linear)" in text
