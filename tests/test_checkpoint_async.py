"""Asynchronous saves (``checkpoint.writer.decoupled``): save_checkpoint returns while the files
are written in the background, training goes on without changing what is saved, the next save
waits for the previous one, and process exit waits for the last."""

from __future__ import annotations

import os

import torch

from ckpt_common import assert_same, snapshot
from distributed import run_distributed
from models import mse

CONFIG = {
    "train_micro_batch_size_per_gpu": 4,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
    "fp16": {"enabled": True, "initial_scale_power": 8},
    "zero_optimization": {"stage": 2, "reduce_bucket_size": 5000},
    "checkpoint": {"writer": {"decoupled": True}},
}


def _model(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(), torch.nn.Linear(256, 256),
                               torch.nn.Tanh(), torch.nn.Linear(256, 8))


def _train(engine, rank, steps):
    g = torch.Generator().manual_seed(engine.global_steps * 10 + rank)
    for _ in range(steps):
        x, y = torch.randn(4, 64, generator=g), torch.randn(4, 8, generator=g)
        engine.backward(mse(engine(x.half()), y))
        engine.step()


def _body(rank, world, root):
    import threading

    import shardwise
    from shardwise.checkpoint import writer

    # A slow disk, made deterministic: the first save's file writing waits until save_checkpoint
    # has returned (or 30 s, if save_checkpoint itself waits for the writing: then "busy" is False).
    returned = threading.Event()
    real_write_files = writer.SavePlan.write_files

    def slow_write_files(plan):
        returned.wait(timeout=30)
        return real_write_files(plan)

    writer.SavePlan.write_files = slow_write_files
    engine, *_ = shardwise.initialize(model=_model(0), config=CONFIG)
    _train(engine, rank, 2)
    at_a = snapshot(engine)
    engine.save_checkpoint(root, tag="a")
    busy_after_return = engine.checkpoint_writer.busy
    returned.set()
    writer.SavePlan.write_files = real_write_files
    _train(engine, rank, 3)  # changes every weight and optimizer state while "a" is being written
    at_b = snapshot(engine)
    engine.save_checkpoint(root, tag="b")  # waits for "a" first
    a_done_before_b = (open(os.path.join(root, "latest")).read() == "a") if rank == 0 else None
    engine.wait_for_checkpoint()
    latest = open(os.path.join(root, "latest")).read()

    loaded = {}
    for tag in ("a", "b"):
        fresh, *_ = shardwise.initialize(model=_model(5), config=CONFIG)
        fresh.load_checkpoint(root, tag=tag)
        loaded[tag] = snapshot(fresh)
    _train(engine, rank, 1)
    engine.save_checkpoint(root, tag="c")  # and return at once: exiting must wait for it
    return {"at_a": at_a, "at_b": at_b, "loaded": loaded, "busy": busy_after_return, "latest": latest,
            "a_done_before_b": a_done_before_b}


def test_async_save_snapshots_state_writes_in_background_and_exit_waits(tmp_path):
    from shardwise.checkpoint import open_checkpoint

    root = str(tmp_path / "ckpt")
    results = run_distributed(_body, 2, args=(root,), timeout=240)
    for rank, r in enumerate(results):
        assert r["busy"], f"rank {rank}: save_checkpoint waited for the writing (not asynchronous)"
        assert_same(r["at_a"], r["loaded"]["a"], f"rank {rank} tag a")
        assert_same(r["at_b"], r["loaded"]["b"], f"rank {rank} tag b")
        assert r["latest"] == "b"
    assert results[0]["a_done_before_b"], "the second save did not wait for the first to be committed"
    # The processes have exited: the last save was completed and committed on the way out.
    ckpt = open_checkpoint(root)
    assert ckpt.tag == "c"
    ckpt.verify()
    assert ckpt.manifest["engine"]["global_steps"] == 6
    assert sorted(os.listdir(root)) == ["a", "b", "c", "latest", "zero_to_fp32.py"]
    assert not [f for f in os.listdir(ckpt.folder) if f.startswith(".")]
