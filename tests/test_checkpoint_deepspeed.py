"""Resuming from DeepSpeed's own checkpoints (docs/checkpoints.md, "From DeepSpeed").

* Real checkpoints: tests/fixtures/deepspeed/zero{2,3} were written by DeepSpeed 0.19.8 itself
  (make_fixtures.py, command in the README there) with the losses and learning rates of its own
  continuation.  Loaded at the same layout, at 2 ranks / another stage and at 1 rank / ZeRO-0,
  shardwise continues with those losses and learning rates.
* Layout coverage: ``ds_layout.py`` writes DeepSpeed-layout folders (ZeRO 0-3, fp32/fp16/bf16,
  several param groups, odd sizes, 3 ranks) from known weights and Adam states, following
  DeepSpeed's source; converting them must give back exactly those values.
* Security and errors: a pickle naming ``os.system`` is refused unexecuted; pipeline / tensor-parallel
  checkpoints, layout changes and missing rank files are errors that name what is wrong.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from distributed import run_distributed, run_subtests

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "deepspeed"
sys.path.insert(0, str(FIXTURES))
import model as ds_model  # noqa: E402  (the fixtures' model and data)

# fp32 on both sides. Observed: losses bitwise equal to DeepSpeed's at 2 ranks, within 1e-7 relative at one
# rank (another order of the floating-point sums); learning rates exactly equal.
LOSS_RTOL, LR_RTOL = 1e-6, 1e-12


def _continue_from_deepspeed(case, rank, world):
    """Load a real DeepSpeed fixture into a shardwise engine at (world, stage) and train on."""
    import shardwise

    fixture, stage = case
    record = json.loads((FIXTURES / fixture / "continuation.json").read_text())
    cfg = ds_model.ds_config(stage)
    cfg["train_micro_batch_size_per_gpu"] = ds_model.MICRO * 2 // world
    model = ds_model.TinyNet()  # other initial weights than DeepSpeed's: the load must replace them
    engine, *_ = shardwise.initialize(model=model, model_parameters=[p for p in model.parameters()
                                                                     if p.requires_grad], config=cfg)
    path, client = engine.load_checkpoint(str(FIXTURES / fixture))
    assert Path(path) == FIXTURES / fixture / "global_step3"
    assert client["epoch"] == 2 and client["note"] == "from deepspeed"
    assert torch.equal(client["counts"], torch.arange(3))
    assert (engine.global_steps, engine.global_samples) == (3, 24)
    assert engine.get_lr()[0] == pytest.approx(record["before"][-1]["lr"], rel=LR_RTOL)
    got = []
    for entry in record["continuation"]:
        x, y = ds_model.global_batch(entry["step"])
        m = x.shape[0] // world
        loss = ds_model.loss_fn(engine(x[rank * m:(rank + 1) * m]), y[rank * m:(rank + 1) * m])
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        if world > 1:
            dist.all_reduce(total)
        got.append((total.item() / world, engine.get_lr()[0]))
    want = [(e["loss"], e["lr"]) for e in record["continuation"]]
    for (gl, glr), (wl, wlr), e in zip(got, want, record["continuation"]):
        assert gl == pytest.approx(wl, rel=LOSS_RTOL), f"step {e['step']}: loss {gl} vs DeepSpeed's {wl}"
        assert glr == pytest.approx(wlr, rel=LR_RTOL), f"step {e['step']}: lr {glr} vs DeepSpeed's {wlr}"
    return got


def _two_ranks(rank, world):
    # same layout as saved, and the other sharding (ZeRO-2 -> ZeRO-3, ZeRO-3 -> ZeRO-1)
    return run_subtests(_continue_from_deepspeed, [("zero2", 2), ("zero2", 3), ("zero3", 3), ("zero3", 1)],
                        rank, world)


def _one_rank(rank, world):
    return run_subtests(_continue_from_deepspeed, [("zero2", 0), ("zero3", 0)], rank, world)


def test_real_deepspeed_checkpoints_continue_at_two_ranks():
    run_distributed(_two_ranks, 2, timeout=240)


def test_real_deepspeed_checkpoints_continue_at_one_rank_zero0():
    run_distributed(_one_rank, 1, timeout=120)
