"""Autotuner: search space and tuners (pure Python), and a real session on the demo GPT that stays
within its trial budget and writes a config that trains."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(ROOT, "examples", "gpt", "train.py")


def _exps(stages, sizes):
    from shardwise.autotuning.space import Experiment

    return [Experiment(s, m) for s in stages for m in sizes]


def _drive(tuner, metric_of):
    order = []
    while (exp := tuner.next()) is not None:
        order.append((exp.stage, exp.micro_batch))
        tuner.record(exp, metric_of(exp))
    return order


def test_gridsearch_order_budget_and_failure_pruning():
    from shardwise.autotuning.tuners import GridSearchTuner

    t = GridSearchTuner(_exps([0, 1], [2, 4, 8]), higher_is_better=True, num_trials=50, early_stopping=0)
    # stage 0 runs out of memory at mbs 4: mbs 8 of stage 0 is not tried
    order = _drive(t, lambda e: None if (e.stage, e.micro_batch) == (0, 4) else float(e.micro_batch + e.stage))
    assert order == [(0, 2), (0, 4), (1, 2), (1, 4), (1, 8)]
    assert t.best == 9.0 and t.stop_reason == "search space exhausted"
    t = GridSearchTuner(_exps([0, 1], [2, 4, 8]), higher_is_better=True, num_trials=4, early_stopping=0)
    assert len(_drive(t, lambda e: 1.0)) == 4 and "tuner_num_trials" in t.stop_reason


def test_early_stopping_and_lower_is_better():
    from shardwise.autotuning.tuners import GridSearchTuner, RandomTuner

    t = GridSearchTuner(_exps([0, 1, 2], [1, 2, 4]), higher_is_better=False, num_trials=50, early_stopping=2)
    latency = {1: 5.0, 2: 3.0, 4: 4.0}
    order = _drive(t, lambda e: latency[e.micro_batch] + e.stage)
    assert order == [(0, 1), (0, 2), (0, 4), (1, 1)]  # best 3.0 at (0, 2), then two trials without a new best
    assert t.best == 3.0 and "tuner_early_stopping" in t.stop_reason
    r = RandomTuner(_exps([0, 1, 2], [1, 2, 4]), higher_is_better=True, num_trials=50, early_stopping=0, seed=3)
    order = _drive(r, lambda e: 1.0)
    assert sorted(order) == sorted((s, m) for s in (0, 1, 2) for m in (1, 2, 4)) and order != sorted(order)


def test_model_based_tries_extremes_then_the_predicted_best():
    from shardwise.autotuning.tuners import ModelBasedTuner

    sizes = [1, 2, 4, 8, 16, 32]
    # throughput peaks at mbs 8, stage 1 is 10% slower than stage 0
    metric = lambda e: (100 - 10 * (e.micro_batch.bit_length() - 4) ** 2) * (0.9 if e.stage else 1.0)  # noqa: E731
    t = ModelBasedTuner(_exps([0, 1], sizes), higher_is_better=True, num_trials=6, early_stopping=0)
    order = _drive(t, metric)
    assert order[:5] == [(0, 1), (0, 32), (1, 1), (1, 32), (0, 4)]  # extremes, then a middle size
    assert order[5] == (0, 8)  # the fitted quadratic in log2(mbs) peaks there


def test_micro_batch_candidates_and_requested_stages(monkeypatch):
    from shardwise.autotuning.space import accepted_stages, micro_batch_candidates, requested_stages
    from shardwise.config import load_config, support

    at = load_config({"autotuning": {"min_train_micro_batch_size_per_gpu": 2,
                                     "max_train_micro_batch_size_per_gpu": 32,
                                     "num_tuning_micro_batch_sizes": 3}}).autotuning
    assert micro_batch_candidates(at, dp_world_size=2, grad_accum=1) == [2, 8, 32]
    capped = load_config({"autotuning": {"max_train_batch_size": 24, "num_tuning_micro_batch_sizes": 2}}).autotuning
    assert micro_batch_candidates(capped, dp_world_size=2, grad_accum=2) == [1, 6]
    assert requested_stages({}) is None and requested_stages({"zero_optimization": {"stage": "all"}}) is None
    assert requested_stages({"zero_optimization": {"stage": [2, 0]}}) == [0, 2]
    with pytest.raises(ValueError, match="expected 0-3"):
        requested_stages({"zero_optimization": {"stage": "two"}})
    assert 0 in accepted_stages({"train_micro_batch_size_per_gpu": 1})
    # pretend stage 1 is not implemented: the tuner asks check_supported, so it must leave stage 1 out
    monkeypatch.setitem(support.NOT_IMPLEMENTED, "zero_optimization.stage", lambda c: c.zero_optimization.stage == 1)
    assert 1 not in accepted_stages({"zero_optimization": {"stage": "all"}})
    assert 0 in accepted_stages({"zero_optimization": {"stage": "all"}})
    with pytest.raises(ValueError, match=r"cannot tune stage 1 \(not implemented yet: zero_optimization.stage"):
        accepted_stages({"zero_optimization": {"stage": [0, 1]}})


def test_autotune_demo_gpt_within_budget_and_best_config_trains(tmp_path):
    cfg = {
        "train_micro_batch_size_per_gpu": 8,
        "steps_per_print": 100,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}},
        "zero_optimization": {"stage": "all", "reduce_bucket_size": 200000},
        "csv_monitor": {"enabled": True, "output_path": str(tmp_path / "logs"), "job_name": "demo"},
        "autotuning": {"enabled": True, "start_profile_step": 1, "end_profile_step": 3,
                       "min_train_micro_batch_size_per_gpu": 2, "max_train_micro_batch_size_per_gpu": 8,
                       "num_tuning_micro_batch_sizes": 2, "tuner_num_trials": 2, "tuner_type": "gridsearch",
                       "results_dir": str(tmp_path / "results"), "exps_dir": str(tmp_path / "exps")},
    }
    (tmp_path / "ds.json").write_text(json.dumps(cfg))
    cmd = [sys.executable, "-m", "shardwise", "autotune", "--num_procs", "2", TRAIN, "--deepspeed",
           "--deepspeed_config", str(tmp_path / "ds.json"), "--steps", "50", "--save_dir", str(tmp_path / "ckpt")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    records = json.loads((tmp_path / "results" / "exps.json").read_text())
    assert len(records) == 2  # tuner_num_trials bounds the real trials (of the 8 the space holds)
    assert sorted(os.listdir(tmp_path / "exps")) == sorted(["model_info"] + [r["name"] for r in records])
    for r in records:
        m = r["metrics"]
        assert r["status"] == "ok" and m["profiled_steps"] == 2 and m["throughput"] > 0
        assert m["throughput"] == pytest.approx(2 * r["settings"]["micro_batch"] / (m["latency"] / 1000), rel=1e-9)
    assert not (tmp_path / "logs").exists()  # trials do not write into the user's monitor logs
    best = max(records, key=lambda r: r["metrics"]["throughput"])
    optimal = json.loads((tmp_path / "results" / "ds_config_optimal.json").read_text())
    assert optimal["zero_optimization"]["stage"] == best["settings"]["stage"]
    assert optimal["train_micro_batch_size_per_gpu"] == best["settings"]["micro_batch"]
    assert "autotuning" not in optimal and optimal["csv_monitor"]["enabled"]
    summary = (tmp_path / "results" / "summary.txt").read_text()
    assert f"best: {best['name']}" in summary and summary.count(" ok ") == 2

    train = [sys.executable, "-m", "shardwise", "run", "--num_procs", "2", TRAIN, "--deepspeed",
             "--deepspeed_config", str(tmp_path / "results" / "ds_config_optimal.json"), "--steps", "4",
             "--save_dir", str(tmp_path / "ckpt")]
    proc = subprocess.run(train, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "after 4 steps" in proc.stdout + proc.stderr
    assert (tmp_path / "logs" / "demo" / "Train_Samples_train_loss.csv").exists()


def test_autotune_needs_the_config_argument(tmp_path, capsys):
    from shardwise.cli import main

    with pytest.raises(SystemExit):
        main(["autotune", "--num_procs", "1", TRAIN, "--steps", "1"])
    assert "--deepspeed_config PATH" in capsys.readouterr().err
