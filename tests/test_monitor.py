"""Monitors: TensorBoard event files, CSV rows and a W&B offline run written by a real 2-rank run."""

from __future__ import annotations

import csv
import glob
import logging
import os
import sys
import time

import pytest
import torch

from distributed import run_distributed, run_subtests
from models import base_config, make_data, make_model, mse

STEPS = 4
PER_RANK = 4


def _monitored_config(out: str, **extra) -> dict:
    return base_config(
        wall_clock_breakdown=True,
        tensorboard={"enabled": True, "output_path": out, "job_name": "tb"},
        csv_monitor={"enabled": True, "output_path": out, "job_name": "csv"},
        wandb={"enabled": True, "project": "shardwise-test"},
        scheduler={"type": "WarmupLR", "params": {"warmup_num_steps": 3, "warmup_max_lr": 0.01, "warmup_type": "linear"}},
        **extra,
    )


def _train(case, rank: int, world: int, root: str):
    import shardwise

    name, extra = case
    out = os.path.join(root, name)
    engine, *_ = shardwise.initialize(model=make_model(), config=_monitored_config(out, **extra))
    x, y = make_data(STEPS, PER_RANK * world)
    losses, lrs, samples, scales = [], [], [], []
    for s in range(STEPS):
        xs, ys = x[s, rank * PER_RANK:(rank + 1) * PER_RANK], y[s, rank * PER_RANK:(rank + 1) * PER_RANK]
        engine.backward(mse(engine(xs), ys))
        engine.step()
        losses.append(engine.get_loss())
        lrs.append(engine.get_lr()[0])
        samples.append(engine.global_samples)
        scales.append(engine.cur_scale)
    engine.monitor.write_events([("Custom/answer", 42.0, 7), ("Custom/tensor", torch.tensor(0.5), 8)])
    engine.monitor.close()
    return {"losses": losses, "lrs": lrs, "samples": samples, "scales": scales, "out": out}


def _body(rank: int, world: int, root: str):
    return run_subtests(_train, [("fp32", {}), ("fp16", {"fp16": {"enabled": True, "auto_cast": True, "initial_scale_power": 8}})],
                        rank, world, root)


def _read_csv(path: str) -> list[list[str]]:
    with open(path, newline="") as f:
        return list(csv.reader(f))


def _read_tensorboard(log_dir: str) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(log_dir, size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("monitor"))
    wandb_dir = os.path.join(root, "wandb-dir")
    os.makedirs(wandb_dir)
    results = run_distributed(_body, 2, args=(root,), timeout=180,
                              env={"WANDB_MODE": "offline", "WANDB_DIR": wandb_dir, "WANDB_SILENT": "true"})
    return results, wandb_dir


@pytest.mark.parametrize("case", [0, 1], ids=["fp32", "fp16"])
def test_csv_rows_equal_engine_losses_and_lrs(two_rank_run, case):
    results, _ = two_rank_run
    r0, r1 = results[0][case], results[1][case]
    mean_losses = [(a + b) / 2 for a, b in zip(r0["losses"], r1["losses"])]
    rows = _read_csv(os.path.join(r0["out"], "csv", "Train_Samples_train_loss.csv"))
    assert rows[0] == ["step", "train_loss"]
    assert [int(r[0]) for r in rows[1:]] == r0["samples"] == [8, 16, 24, 32]
    assert [float(r[1]) for r in rows[1:]] == pytest.approx(mean_losses, rel=1e-12, abs=0)
    assert r0["losses"] != r1["losses"]  # the ranks saw different data: the mean is a real reduction
    lr_rows = _read_csv(os.path.join(r0["out"], "csv", "Train_Samples_lr.csv"))
    assert [float(r[1]) for r in lr_rows[1:]] == r0["lrs"]
    custom = _read_csv(os.path.join(r0["out"], "csv", "Custom_answer.csv"))
    assert custom == [["step", "answer"], ["7", "42.0"]]
    has_scale = os.path.exists(os.path.join(r0["out"], "csv", "Train_Samples_loss_scale.csv"))
    assert has_scale == (case == 1)
    if has_scale:
        scale_rows = _read_csv(os.path.join(r0["out"], "csv", "Train_Samples_loss_scale.csv"))
        assert [float(r[1]) for r in scale_rows[1:]] == r0["scales"]


def test_tensorboard_event_files_have_the_tags_and_values(two_rank_run):
    results, _ = two_rank_run
    r0, r1 = results[0][0], results[1][0]
    scalars = _read_tensorboard(os.path.join(r0["out"], "tb"))
    expected = {"Train/Samples/train_loss", "Train/Samples/lr", "Train/Samples/grad_norm",
                "Train/Samples/samples_per_sec", "Train/Samples/step_time_ms",
                "Train/Samples/elapsed_time_ms_forward", "Train/Samples/elapsed_time_ms_backward",
                "Train/Samples/elapsed_time_ms_backward_inner", "Train/Samples/elapsed_time_ms_backward_allreduce",
                "Train/Samples/elapsed_time_ms_step", "Custom/answer", "Custom/tensor"}
    assert expected <= set(scalars), sorted(set(scalars))
    assert "Train/Samples/loss_scale" not in scalars  # fp32: no loss scaler
    loss = scalars["Train/Samples/train_loss"]
    assert [s for s, _ in loss] == r0["samples"]
    mean_losses = [(a + b) / 2 for a, b in zip(r0["losses"], r1["losses"])]
    assert [v for _, v in loss] == pytest.approx(mean_losses, rel=1e-6)  # event files store float32
    assert [v for _, v in scalars["Train/Samples/lr"]] == pytest.approx(r0["lrs"], rel=1e-6)
    assert scalars["Custom/tensor"] == [(8, 0.5)]
    for tag in ("Train/Samples/elapsed_time_ms_forward", "Train/Samples/step_time_ms"):
        assert len(scalars[tag]) == STEPS and all(v > 0 for _, v in scalars[tag])
    fwd = dict(scalars["Train/Samples/elapsed_time_ms_forward"])
    step_ms = dict(scalars["Train/Samples/step_time_ms"])
    assert all(fwd[s] < step_ms[s] for s in fwd)  # a part of the step is shorter than the step


def test_only_rank0_writes_and_wandb_offline_run_exists(two_rank_run):
    results, wandb_dir = two_rank_run
    out = results[0][0]["out"]
    assert len(glob.glob(os.path.join(out, "tb", "events.out.tfevents.*"))) == 1
    rows = _read_csv(os.path.join(out, "csv", "Train_Samples_lr.csv"))
    assert len(rows) == 1 + STEPS  # rank 1 wrote nothing
    runs = glob.glob(os.path.join(wandb_dir, "wandb", "offline-run-*"))
    assert len(runs) == 2, runs  # one per sub-case, both from rank 0
    assert all(glob.glob(os.path.join(r, "run-*.wandb")) for r in runs)


def test_wandb_unreachable_never_blocks_and_warns_once(monkeypatch, caplog, tmp_path):
    from shardwise.monitor.wandb_monitor import WandbMonitor

    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")  # nothing listens on the discard port
    monkeypatch.setenv("WANDB_API_KEY", "local-" + "0" * 40)
    monkeypatch.setenv("WANDB_INIT_TIMEOUT", "3")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    with caplog.at_level(logging.WARNING, logger="shardwise"):
        mon = WandbMonitor(project="unreachable")
        t0 = time.perf_counter()
        for step in range(200):
            mon.write_events([("Train/Samples/train_loss", 1.0, step)])
        assert time.perf_counter() - t0 < 0.5  # training never waits for the server
        assert mon.ready.wait(60), "wandb.init neither succeeded nor failed"
        mon.write_events([("Train/Samples/train_loss", 1.0, 999)])
        t0 = time.perf_counter()
        mon.close()
        assert time.perf_counter() - t0 < 5
    warnings = [r.getMessage() for r in caplog.records if "wandb monitor disabled" in r.getMessage()]
    assert len(warnings) == 1 and "wandb.init failed" in warnings[0], warnings


def test_wandb_missing_package_warns_once(monkeypatch, caplog):
    from shardwise.monitor.wandb_monitor import WandbMonitor

    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` now raises ImportError
    with caplog.at_level(logging.WARNING, logger="shardwise"):
        mon = WandbMonitor(project="p")
        assert mon.ready.wait(10)
        mon.write_events([("a", 1.0, 1)])
        mon.close()
    warnings = [r.getMessage() for r in caplog.records if "wandb monitor disabled" in r.getMessage()]
    assert len(warnings) == 1 and "not installed" in warnings[0]


def test_write_events_rejects_malformed_events(tmp_path):
    from shardwise.config import load_config
    from shardwise.monitor import MonitorMaster

    cfg = load_config({"train_micro_batch_size_per_gpu": 1,
                       "csv_monitor": {"enabled": True, "output_path": str(tmp_path), "job_name": "j"}})
    mon = MonitorMaster(cfg, rank=0)
    with pytest.raises(ValueError, match=r"event 1 must be a \(tag: str, value, step: int\)"):
        mon.write_events([("ok", 1.0, 1), ("missing step", 2.0)])
    with pytest.raises(ValueError, match="event 0 .'x'.: value and step must be numbers"):
        mon.write_events([("x", "not a number", 1)])
    mon.close()
    assert MonitorMaster(cfg, rank=1).monitors == [] and MonitorMaster(cfg, rank=1).enabled
