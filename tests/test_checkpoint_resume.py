"""Exact resume across process restarts: train K steps and save in one group of processes, load in
a fresh group and train L more: bitwise the same losses, samples, parameters, optimizer state and
counters as K+L steps uninterrupted, for ZeRO stages 0-3 at world size 2."""

from __future__ import annotations

import json
import os

import torch

from ckpt_common import DropoutMLP, IndexedData, assert_same, snapshot
from distributed import run_distributed, run_subtests
from models import mse

K, L, GAS, N = 3, 4, 2, 36  # 36 samples, 8 per step: the save is mid-epoch, the resume crosses an epoch
PRECISION = {0: {}, 1: {"fp16": {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 2}},
             2: {"bf16": {"enabled": True}}, 3: {"fp16": {"enabled": True, "initial_scale_power": 8}}}


def _config(stage: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": GAS, "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2,
                                                     "warmup_num_steps": 10}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 40, "stage3_param_persistence_threshold": 0},
        **PRECISION[stage],
    }


def _engine(stage: int, seed: int):
    import shardwise

    torch.manual_seed(seed)
    engine, _, loader, _ = shardwise.initialize(model=DropoutMLP(), config=_config(stage), training_data=IndexedData(N))
    return engine, shardwise.RepeatingLoader(loader)


def _train(engine, batches, steps: int):
    losses, seen = [], []
    for _ in range(steps * GAS):
        x, y, idx = next(batches)
        loss = mse(engine(x.to(engine.precision.param_dtype)), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        seen.extend(idx.tolist())
    return losses, seen


def _first_run(stage, rank, root):
    engine, batches = _engine(stage, seed=0)
    torch.manual_seed(100 + rank)  # ranks draw different dropout masks
    _, seen_before = _train(engine, batches, K)
    client = {"epoch": 0, "note": "hi", "best": torch.tensor([1.5, 2.5]), "pair": (1, (2, 3)), "d": {3: "x"}}
    engine.save_checkpoint(os.path.join(root, f"stage{stage}"), client_state=client)
    saved = snapshot(engine)
    losses, seen = _train(engine, batches, L)
    return {"saved": saved, "seen_before": seen_before, "losses": losses, "seen": seen, "final": snapshot(engine)}


def _resumed_run(stage, rank, root):
    engine, batches = _engine(stage, seed=99)  # other weights; the loader is wrapped before the load
    torch.manual_seed(555)
    path, client = engine.load_checkpoint(os.path.join(root, f"stage{stage}"))
    loaded = snapshot(engine)
    losses, seen = _train(engine, batches, L)
    return {"path": path, "client": client, "loaded": loaded, "losses": losses, "seen": seen,
            "final": snapshot(engine)}


def _body(rank, world, root, resumed):
    torch.use_deterministic_algorithms(True)
    return run_subtests(_resumed_run if resumed else _first_run, [0, 1, 2, 3], rank, root)


def test_resume_in_new_processes_is_bitwise_for_stages_0_to_3(tmp_path):
    first = run_distributed(_body, 2, args=(str(tmp_path), False), timeout=300)
    second = run_distributed(_body, 2, args=(str(tmp_path), True), timeout=300)
    for si, stage in enumerate((0, 1, 2, 3)):
        for rank in range(2):
            a, b = first[rank][si], second[rank][si]
            where = f"stage {stage} rank {rank}"
            assert b["path"] == str(tmp_path / f"stage{stage}" / f"global_step{K}")
            assert_same(a["saved"], b["loaded"], f"{where} loaded")
            assert a["saved"]["opt"] and a["saved"]["counters"][0] == K, "nothing trained before the save"
            assert a["losses"] == b["losses"], f"{where}: losses after resume differ"
            assert a["seen"] == b["seen"], f"{where}: samples after resume differ"
            assert_same(a["final"], b["final"], f"{where} final")
            c = b["client"]
            assert (c["epoch"], c["note"], c["pair"], c["d"]) == (0, "hi", (1, (2, 3)), {3: "x"})
            assert torch.equal(c["best"], torch.tensor([1.5, 2.5]))
        # No sample repeated or skipped: epoch 0 is covered exactly once across the restart.
        rest = N // 2 - K * GAS * 2  # samples of epoch 0 each rank still had to see after the save
        epoch0 = [i for r in range(2) for i in first[r][si]["seen_before"] + second[r][si]["seen"][:rest]]
        assert sorted(epoch0) == list(range(N)), f"stage {stage}: epoch 0 not covered exactly once"
        manifest = json.loads((tmp_path / f"stage{stage}" / f"global_step{K}" / "manifest.json").read_text())
        assert manifest["engine"]["data"] == {"epoch": 0, "consumed": K * GAS * 2 * 2}
        assert manifest["topology"] == {"world_size": 2, "dp_world_size": 2, "zero_stage": stage}
        written = {f for f in manifest["files"] if f.startswith("optim_rank")}
        assert written == ({"optim_rank0.safetensors"} if stage == 0 else {"optim_rank0.safetensors",
                                                                            "optim_rank1.safetensors"})
        assert sorted(os.listdir(tmp_path / f"stage{stage}")) == [f"global_step{K}", "latest", "zero_to_fp32.py"]
