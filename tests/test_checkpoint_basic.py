"""save_checkpoint / load_checkpoint round trip: everything comes back and training continues bitwise."""

from __future__ import annotations

import json
import os

import pytest
import torch

from distributed import run_distributed
from models import base_config, make_data, make_model, mse

CFG = base_config(
    fp16={"enabled": True, "initial_scale_power": 10, "loss_scale_window": 2},
    scheduler={"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2, "warmup_num_steps": 10}},
)


def _train(engine, rank, x, y, steps, start):
    losses = []
    for s in range(start, start + steps):
        loss = mse(engine(x[s, rank * 4 : (rank + 1) * 4].half()), y[s, rank * 4 : (rank + 1) * 4])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _snapshot(engine):
    opt_state = {
        f"{i}/{k}": v.clone() if isinstance(v, torch.Tensor) else v
        for i, p in enumerate(p for g in engine.optimizer.param_groups for p in g["params"])
        for k, v in engine.optimizer.state.get(p, {}).items()
    }
    return {
        "params": {n: p.detach().clone() for n, p in engine.module.named_parameters()},
        "masters": {n: t.clone() for n, t in engine.strategy.master_named_params().items()},
        "opt": opt_state,
        "lr": engine.get_lr(),
        "sched": engine.lr_scheduler.state_dict(),
        "scaler": engine.loss_scaler.state_dict(),
        "counters": (engine.global_steps, engine.global_samples, engine.micro_steps, engine.skipped_steps),
    }


def _round_trip_body(rank, world, save_root):
    return {stage: _round_trip(rank, os.path.join(save_root, f"stage{stage}"), stage) for stage in (0, 1, 2)}


def _round_trip(rank, save_dir, stage):
    import shardwise

    cfg = {**CFG, "zero_optimization": {"stage": stage, "reduce_bucket_size": 40}}
    x, y = make_data(6, 8)
    engine, *_ = shardwise.initialize(model=make_model(), config=cfg)
    _train(engine, rank, x, y, 3, 0)
    client = {"epoch": 7, "note": "hello", "best": torch.tensor([1.5, 2.5]), "pair": (1, 2)}
    engine.save_checkpoint(save_dir, client_state=client)
    saved = _snapshot(engine)
    continued = _train(engine, rank, x, y, 3, 3)
    final = _snapshot(engine)

    fresh, *_ = shardwise.initialize(model=make_model(seed=99), config=cfg)
    path, client_back = fresh.load_checkpoint(save_dir)
    loaded = _snapshot(fresh)
    resumed = _train(fresh, rank, x, y, 3, 3)
    return {"saved": saved, "loaded": loaded, "final": final, "resumed_final": _snapshot(fresh),
            "continued": continued, "resumed": resumed, "client": client_back, "path": path}


def _assert_snapshots_equal(a, b):
    for key in ("params", "masters", "opt"):
        assert a[key].keys() == b[key].keys(), key
        for n in a[key]:
            va, vb = a[key][n], b[key][n]
            if isinstance(va, torch.Tensor):
                assert torch.equal(va, vb), f"{key}[{n}] differs"
            else:
                assert va == vb, f"{key}[{n}] differs"
    for key in ("lr", "sched", "scaler", "counters"):
        assert a[key] == b[key], key


def test_save_load_round_trip_restores_everything_and_resumes_bitwise_stages_0_1_2(tmp_path):
    results = run_distributed(_round_trip_body, 2, args=(str(tmp_path),), timeout=240)
    for stage in (0, 1, 2):
        _check_round_trip([r[stage] for r in results], str(tmp_path / f"stage{stage}"), stage)


def _check_round_trip(results, save_dir, stage):
    for r in results:
        assert r["path"] == os.path.join(save_dir, "global_step3")
        _assert_snapshots_equal(r["saved"], r["loaded"])
        assert r["saved"]["counters"][0] == 3 and r["saved"]["opt"], "nothing was trained before saving"
        assert r["client"]["epoch"] == 7 and r["client"]["note"] == "hello" and r["client"]["pair"] == (1, 2)
        assert torch.equal(r["client"]["best"], torch.tensor([1.5, 2.5]))
        assert r["continued"] == r["resumed"]
        _assert_snapshots_equal(r["final"], r["resumed_final"])
    # On disk: a finished tag, 'latest', a manifest with checksums, no temporary folder, no pickle.
    assert open(os.path.join(save_dir, "latest")).read() == "global_step3"
    names = sorted(os.listdir(save_dir))
    assert names == ["global_step3", "latest"], names
    manifest = json.load(open(os.path.join(save_dir, "global_step3", "manifest.json")))
    files = sorted(os.listdir(os.path.join(save_dir, "global_step3")))
    assert set(manifest["files"]) == set(files) - {"manifest.json"}
    assert not [f for f in files if f.endswith((".pt", ".pkl", ".bin"))]
    assert manifest["engine"]["global_steps"] == 3 and manifest["topology"]["dp_world_size"] == 2
    assert manifest["topology"]["zero_stage"] == stage
    # Partitioned stages: each rank wrote its own share of the optimizer state.
    writers = {f for f in files if f.startswith("optim_rank")}
    assert writers == ({"optim_rank0.safetensors"} if stage == 0 else {"optim_rank0.safetensors", "optim_rank1.safetensors"})


def _corrupt_body(rank, world, save_dir):
    import shardwise

    engine, *_ = shardwise.initialize(model=make_model(), config=base_config())
    try:
        engine.load_checkpoint(save_dir)
    except ValueError as e:
        return str(e)
    return "loaded"


def _save_once_body(rank, world, save_dir):
    import shardwise

    engine, *_ = shardwise.initialize(model=make_model(), config=base_config())
    x, y = make_data(1, 4)
    engine.backward(mse(engine(x[0]), y[0]))
    engine.step()
    engine.save_checkpoint(save_dir, tag="t1")


def test_corrupted_shard_is_named_and_missing_tag_lists_existing(tmp_path):
    save_dir = str(tmp_path / "ckpt")
    run_distributed(_save_once_body, 1, args=(save_dir,), timeout=120)
    model_file = tmp_path / "ckpt" / "t1" / "model.safetensors"
    data = bytearray(model_file.read_bytes())
    data[-3] ^= 0xFF
    model_file.write_bytes(bytes(data))
    (msg,) = run_distributed(_corrupt_body, 1, args=(save_dir,), timeout=120)
    assert "model.safetensors" in msg and "sha256" in msg

    from shardwise.checkpoint.engine_io import resolve_tag

    with pytest.raises(FileNotFoundError, match="tags there: t1"):
        resolve_tag(tmp_path / "ckpt", "nope")
