"""Reshard on load: a checkpoint saved at (world size N, ZeRO stage s) loads at (M, t) — with or
without optimizer/parameter offload — restores the whole fp32 weights and optimizer states
exactly, and training goes on with the losses of a reference run continued on the original
layout (fp32; only the order of floating-point sums differs)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from distributed import run_distributed, run_subtests
from models import make_data, make_model, mse

K, L, BATCH = 3, 3, 8
SOURCES = [(2, 1), (2, 2), (2, 3), (4, 3)]  # (world, stage) of the saves
# Per load world: source -> (stage, offload) it is loaded into.
TARGETS = {
    1: {src: (0, None) for src in SOURCES},
    2: {(2, 1): (2, None), (2, 2): (3, None), (2, 3): (1, "cpu"), (4, 3): (0, None)},
    4: {(2, 1): (3, "nvme"), (2, 2): (1, None), (2, 3): (2, None), (4, 3): (3, "infinity")},
}


def _config(world, stage, offload, nvme_dir):
    zero = {"stage": stage, "reduce_bucket_size": 40, "stage3_param_persistence_threshold": 0}
    if offload == "cpu":
        zero["offload_optimizer"] = {"device": "cpu"}
    elif offload == "nvme":
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme_dir, "buffer_count": 2}
        zero["sub_group_size"] = 100  # several sub-groups, resident one at a time
    elif offload == "infinity":  # parameters and optimizer on NVMe
        zero["offload_param"] = {"device": "nvme", "nvme_path": nvme_dir}
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme_dir, "buffer_count": 2}
    return {
        "train_micro_batch_size_per_gpu": BATCH // world, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 2e-2, "weight_decay": 0.01}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 2e-2,
                                                     "warmup_num_steps": 4}},
        "zero_optimization": zero,
    }


def _engine(world, stage, offload, nvme_dir, seed):
    import shardwise

    engine, *_ = shardwise.initialize(model=make_model(seed), config=_config(world, stage, offload, nvme_dir))
    return engine


def _train(engine, rank, world, start, steps):
    """Global mean losses (every rank's micro-batch is an equal slice of the same global batch)."""
    x, y = make_data(K + L, BATCH)
    m = BATCH // world
    losses = []
    for s in range(start, start + steps):
        loss = mse(engine(x[s, rank * m : (rank + 1) * m]), y[s, rank * m : (rank + 1) * m])
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    return losses


def _full_state(engine):
    """Whole fp32 weights and Adam states of every parameter. Collective."""
    from shardwise.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    out = {}
    for n, p in engine.module.named_parameters():
        out[n] = safe_get_full_fp32_param(p).clone()
        if p.requires_grad:
            for key in ("exp_avg", "exp_avg_sq"):
                out[f"{n}/{key}"] = safe_get_full_optimizer_state(p, key).clone()
    return out


def _save(src, rank, world, root):
    _, stage = src
    engine = _engine(world, stage, None, None, seed=0)
    _train(engine, rank, world, 0, K)
    engine.save_checkpoint(os.path.join(root, f"w{world}s{stage}"))
    saved = _full_state(engine)
    return {"saved": saved, "losses": _train(engine, rank, world, K, L), "final": _full_state(engine)}


def _load(src, rank, world, root):
    stage, offload = TARGETS[world][src]
    engine = _engine(world, stage, offload, os.path.join(root, f"nvme{rank}"), seed=7)
    engine.load_checkpoint(os.path.join(root, f"w{src[0]}s{src[1]}"))
    loaded = _full_state(engine)
    assert engine.global_steps == K and engine.get_lr()[0] > 0
    return {"loaded": loaded, "losses": _train(engine, rank, world, K, L), "final": _full_state(engine)}


def _save_body(rank, world, root):
    return run_subtests(_save, [s for s in SOURCES if s[0] == world], rank, world, root)


def _load_body(rank, world, root):
    return run_subtests(_load, SOURCES, rank, world, root)


def _save_then_load_body(rank, world, root):  # world 4: one group of processes saves, then loads all
    return _save_body(rank, world, root), _load_body(rank, world, root)


def test_checkpoints_reshard_across_world_sizes_stages_and_offload(tmp_path):
    root = str(tmp_path)
    saves = dict(zip([s for s in SOURCES if s[0] == 2], run_distributed(_save_body, 2, args=(root,), timeout=300)[0]))
    saved4, loads4 = run_distributed(_save_then_load_body, 4, args=(root,), timeout=300)[0]
    saves[(4, 3)] = saved4[0]
    loads = {4: loads4}
    for world in (1, 2):
        loads[world] = run_distributed(_load_body, world, args=(root,), timeout=300)[0]
    for world, results in loads.items():
        for src, got in zip(SOURCES, results):
            where = f"saved at world {src[0]} stage {src[1]}, loaded at world {world} {TARGETS[world][src]}"
            ref = saves[src]
            assert ref["saved"].keys() == got["loaded"].keys()
            for name, value in ref["saved"].items():  # weights and optimizer states come back exactly
                assert torch.equal(value, got["loaded"][name]), f"{where}: {name} not restored exactly"
            torch.testing.assert_close(got["losses"], ref["losses"], rtol=1e-6, atol=0, msg=where)
            for name, value in ref["final"].items():
                torch.testing.assert_close(got["final"][name], value, rtol=1e-6, atol=1e-7,
                                           msg=lambda m, n=name: f"{where}: {n}: {m}")
