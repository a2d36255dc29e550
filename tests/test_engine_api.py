"""The DeepSpeed-shaped public API: initialize(), engine accessors, data loading, misuse errors."""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys

import pytest
import torch

from distributed import run_distributed
from models import base_config, make_data, make_model, mse


def _api_body(rank: int, world: int, cfg_path: str):
    import shardwise

    out = {}
    # Config from argparse, exactly as a DeepSpeed script passes it.
    parser = shardwise.add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", cfg_path])
    dataset = torch.utils.data.TensorDataset(torch.arange(40, dtype=torch.float32).unsqueeze(1).repeat(1, 7),
                                             torch.zeros(40, 3))
    engine, opt, loader, sched = shardwise.initialize(args=args, model=make_model(), training_data=dataset)
    out["batch"] = (engine.train_batch_size(), engine.train_micro_batch_size_per_gpu(),
                    engine.gradient_accumulation_steps())
    out["opt_is_torch"] = isinstance(opt, torch.optim.AdamW)
    out["sched"] = type(sched).__name__
    out["lr0"] = engine.get_lr()
    # The loader gives this rank its own disjoint share.
    seen = [int(x[0, 0]) for x, _ in loader for x in x.split(1)]
    out["seen"] = seen
    boundaries = []
    for i, (x, y) in enumerate(loader):
        boundaries.append(engine.is_gradient_accumulation_boundary())
        engine.backward(mse(engine(x), y))
        engine.step()
    out["boundaries"] = boundaries
    out["steps"] = (engine.global_steps, engine.micro_steps, engine.global_samples)
    out["norm"] = engine.get_global_grad_norm()
    out["lr1"] = engine.get_lr()
    out["module_attr"] = engine.fc1.in_features  # attribute look-ups fall through to the module

    # loss.backward() instead of engine.backward(): a clear error instead of silently unsynchronised gradients.
    x, y = make_data(1, 4)
    engine2, *_ = shardwise.initialize(model=make_model(), config=base_config(gradient_accumulation_steps=1))
    mse(engine2(x[0]), y[0]).backward()
    try:
        engine2.step()
        out["misuse"] = None
    except RuntimeError as e:
        out["misuse"] = str(e)

    # no_sync: gradients stay local (differ across ranks) until a synchronised backward.
    engine3, *_ = shardwise.initialize(model=make_model(), config=base_config(gradient_accumulation_steps=2))
    xr, yr = make_data(1, 8, seed=10 + rank)
    with engine3.no_sync():
        engine3.backward(mse(engine3(xr[0, :4]), yr[0, :4]))
    local = engine3.module.fc1.weight.grad.clone()
    gathered = [torch.zeros_like(local) for _ in range(world)]
    torch.distributed.all_gather(gathered, local)
    out["no_sync_differs"] = not torch.equal(gathered[0], gathered[1])
    engine3.step()
    engine3.backward(mse(engine3(xr[0, 4:]), yr[0, 4:]))
    synced = engine3.module.fc1.weight.grad.clone()
    torch.distributed.all_gather(gathered, synced)
    out["synced_equal"] = torch.equal(gathered[0], gathered[1])
    engine3.step()
    return out


def test_initialize_from_args_loader_accessors_and_misuse(tmp_path):
    cfg = base_config(
        train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=5,
        scheduler={"type": "WarmupLR", "params": {"warmup_max_lr": 0.01, "warmup_num_steps": 4,
                                                   "warmup_type": "linear"}},
    )
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(cfg))
    r0, r1 = run_distributed(_api_body, 2, args=(str(path),), timeout=180)
    assert r0["batch"] == (20, 2, 5)
    assert r0["opt_is_torch"] and r0["sched"] == "WarmupLR"
    # 40 samples over 2 ranks: disjoint halves covering everything.
    assert len(r0["seen"]) == len(r1["seen"]) == 20
    assert sorted(r0["seen"] + r1["seen"]) == list(range(40))
    # 10 micro-batches of 2 per rank: an optimizer step on every 5th micro-step.
    assert r0["boundaries"] == [False, False, False, False, True] * 2
    assert r0["steps"] == (2, 10, 40)
    assert r0["norm"] is not None and r0["norm"] > 0
    # Linear warm-up: lr = max_lr * iteration / warmup_num_steps; two scheduler steps -> iteration 1.
    assert r0["lr0"] == [0.0] and r0["lr1"] == [pytest.approx(0.01 * 1 / 4)]
    assert r0["module_attr"] == 7
    assert "engine.backward(loss)" in r0["misuse"]
    assert r0["no_sync_differs"] and r0["synced_equal"]


def _overlap_body(rank: int, world: int):
    import shardwise

    model = make_model()
    engine, *_ = shardwise.initialize(model=model, config=base_config(zero_optimization={"stage": 0, "reduce_bucket_size": 20}))
    strategy = engine.strategy
    launched_when_first_layer_ready = []
    # fc1.weight is the last gradient autograd produces; our hook runs after the engine's own.
    model.fc1.weight.register_post_accumulate_grad_hook(
        lambda p: launched_when_first_layer_ready.append(strategy.reducer._launched)
    )
    x, y = make_data(1, 8)
    engine.backward(mse(engine(x[0, :4]), y[0, :4]))
    engine.step()
    return launched_when_first_layer_ready, len(strategy.buckets)


def test_reduction_overlaps_backward():
    (launched, buckets), _ = run_distributed(_overlap_body, 2, timeout=120)
    assert buckets >= 4
    # Before the last gradient even exists, earlier buckets are already on the wire.
    assert launched[0] >= 2, (launched, buckets)


def test_config_errors_surface_through_initialize():
    import shardwise

    with pytest.raises(ValueError, match="did you mean 'gradient_clipping'"):
        shardwise.initialize(model=make_model(), config=base_config(gradient_clipp1ng=1.0))
    with pytest.raises(ValueError, match=r"train_batch_size \(32\).*= 16"):
        shardwise.initialize(model=make_model(), config={"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4,
                                                          "gradient_accumulation_steps": 4})
    with pytest.raises(ValueError, match="zero_optimization.reduce_bucket_size"):
        shardwise.initialize(model=make_model(), config=base_config(zero_optimization={"reduce_bucket_size": "big"}))
    # a client optimizer next to a config 'optimizer' block wins, as in DeepSpeed (tests/test_deepspeed_compat.py)
    with pytest.raises(ValueError, match="no config"):
        shardwise.initialize(model=make_model())


def test_single_process_without_launcher_and_wall_clock_breakdown(caplog):
    """A plain `python train.py` (no launcher env) trains as a world of one and prints timings."""
    import shardwise

    cfg = base_config(steps_per_print=2, wall_clock_breakdown=True)
    engine, opt, _, _ = shardwise.initialize(model=make_model(), config=cfg)
    assert engine.world_size == 1 and engine.dp_world_size == 1
    x, y = make_data(4, 4)
    with caplog.at_level(logging.INFO, logger="shardwise"):
        for s in range(4):
            engine.backward(mse(engine(x[s]), y[s]))
            engine.step()
    text = caplog.text
    assert "step=2" in text and "step=4" in text and "samples/sec" in text
    assert "forward:" in text and "backward:" in text and "step:" in text


def test_import_is_light():
    # (tqdm is left out: torch itself imports it when installed.)
    code = ("import sys, shardwise; heavy = [m for m in ('safetensors', 'tensorboard', 'transformers', "
            "'wandb', 'fastapi', 'pydantic') if m in sys.modules]; print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


_PRINTING_SCRIPT = """
import logging, sys, torch, shardwise
if sys.argv[1] == "configured":
    logging.basicConfig(level=logging.INFO, format="APP %(message)s", stream=sys.stdout)
torch.manual_seed(0)
engine, *_ = shardwise.initialize(model=torch.nn.Linear(4, 1), config={
    "train_micro_batch_size_per_gpu": 2, "steps_per_print": 1,
    "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
for _ in range(2):
    engine.backward(engine(torch.ones(2, 4)).pow(2).mean())
    engine.step()
"""


def test_steps_per_print_is_seen_in_a_plain_script_and_once_when_the_app_configures_logging():
    """DeepSpeed's logger prints INFO on stdout: a user's ``steps_per_print`` must show up without
    any logging set-up, and exactly once (through the app's handler) when the app configured logging."""
    for mode in ("plain", "configured"):
        out = subprocess.run([sys.executable, "-c", _PRINTING_SCRIPT, mode], capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        lines = [line for line in out.stdout.splitlines() if "step=2," in line]
        assert len(lines) == 1, (mode, out.stdout)
        if mode == "plain":
            assert "[INFO]" in lines[0] and "engine.py" in lines[0], lines[0]
        else:
            assert lines[0].startswith("APP step=2,"), lines[0]
