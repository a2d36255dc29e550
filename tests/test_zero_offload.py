"""ZeRO-Offload: optimizer (stages 1-3) to CPU and NVMe reproduces plain training; NVMe keeps the
optimizer state in files, not in memory."""

from __future__ import annotations

import os

import torch

from distributed import run_distributed
from models import base_config, make_data, make_model, make_tied_model, mse, reference_training_for
from test_zero3 import STEPS, BATCH, _train


def _cfg(stage, device, nvme_dir, **extra):
    z = {"stage": stage, "reduce_bucket_size": 40, "sub_group_size": 60,
         "offload_optimizer": {"device": device, "nvme_path": nvme_dir, "buffer_count": 2}}
    if stage == 3:
        z["stage3_param_persistence_threshold"] = 0
    z.update(extra)
    return base_config(train_micro_batch_size_per_gpu=BATCH // 2, zero_optimization=z)


def _parity_body(rank, world, nvme_dir):
    out = {}
    for stage in (1, 2, 3):
        for device in ("cpu", "nvme"):
            make = make_tied_model if stage == 3 else make_model
            out[(stage, device)] = _train(rank, world, make, _cfg(stage, device, nvme_dir))
    return out


def test_optimizer_offload_cpu_and_nvme_match_single_process(tmp_path):
    nvme = str(tmp_path / "nvme")
    results = run_distributed(_parity_body, 2, args=(nvme,), timeout=300)
    refs = {False: reference_training_for(make_model(), STEPS, BATCH),
            True: reference_training_for(make_tied_model(), STEPS, BATCH)}
    for (stage, device), _ in results[0].items():
        ref_losses, ref_params = refs[stage == 3]
        for r in results:
            losses, params = r[(stage, device)]
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-6, atol=1e-7)
            for n in ref_params:
                torch.testing.assert_close(params[n], ref_params[n], rtol=1e-5, atol=1e-6,
                                           msg=f"stage {stage} {device}: {n}")
    # The swap files went away with the processes.
    assert not [d for d in os.listdir(nvme) if d.startswith("shardwise-")]


def _deep(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    layers = [torch.nn.Linear(7, 16), torch.nn.Tanh()]
    for _ in range(8):
        layers += [torch.nn.Linear(16, 16), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(16, 3))


def _nvme_body(rank, world, nvme_dir, ckpt_dir):
    import shardwise

    cfg = _cfg(2, "nvme", nvme_dir, sub_group_size=150)
    engine, opt, *_ = shardwise.initialize(model=_deep(), config=cfg)
    swapper = engine.strategy.swapper
    peak = [0]
    original_step = opt.step

    def observed_step(*a, **k):  # resident per-element optimizer state while the optimizer runs
        original_step(*a, **k)
        resident = sum(v.nbytes for s in opt.state.values() for key, v in s.items()
                       if key != "step" and isinstance(v, torch.Tensor))
        resident += sum(p.nbytes for g in opt.param_groups for p in g["params"])
        peak[0] = max(peak[0], resident)

    opt.step = observed_step
    x, y = make_data(6, BATCH)
    per = BATCH // world
    losses = []
    for s in range(3):
        engine.backward(mse(engine(x[s, rank * per:(rank + 1) * per]), y[s, rank * per:(rank + 1) * per]))
        engine.step()
    m = engine.memory_breakdown()
    engine.save_checkpoint(ckpt_dir)
    for s in range(3, 6):
        loss = mse(engine(x[s, rank * per:(rank + 1) * per]), y[s, rank * per:(rank + 1) * per])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    fresh, *_ = shardwise.initialize(model=_deep(seed=5), config=cfg)
    fresh.load_checkpoint(ckpt_dir)
    resumed = []
    for s in range(3, 6):
        loss = mse(fresh(x[s, rank * per:(rank + 1) * per]), y[s, rank * per:(rank + 1) * per])
        fresh.backward(loss)
        fresh.step()
        resumed.append(loss.item())
    owned = sum(f.numel for frags in engine.strategy.fragments for f in frags)
    return {"m": m.as_dict(), "peak": peak[0], "owned": owned, "subgroups": len(swapper.subgroups),
            "biggest": max(sg.numel for sg in swapper.subgroups), "losses": losses, "resumed": resumed}


def test_nvme_offload_keeps_states_on_disk_bounded_in_memory_and_resumes(tmp_path):
    results = run_distributed(_nvme_body, 2, args=(str(tmp_path / "nvme"), str(tmp_path / "ckpt")), timeout=300)
    for r in results:
        m = r["m"]
        assert r["subgroups"] >= 3
        # Outside the step nothing of the fp32 weights or Adam states stays in memory ...
        assert m["master_params"] == 0 and m["optimizer_states"] == 0
        # ... the files hold weights + exp_avg + exp_avg_sq for every owned element ...
        assert m["on_disk"] >= 12 * r["owned"]
        # ... and during the step at most two sub-groups (buffer_count 2) were resident at once.
        assert r["peak"] <= 2 * r["biggest"] * 12 < 12 * r["owned"]
        assert r["losses"] == r["resumed"], "resume from a checkpoint under NVMe offload must be exact"


def _param_offload_body(rank, world, nvme_dir):
    out = {}
    for device in ("cpu", "nvme"):
        cfg = _cfg(3, device, nvme_dir)
        cfg["zero_optimization"]["offload_param"] = {"device": device, "nvme_path": nvme_dir}
        out[device] = _train(rank, world, make_tied_model, cfg)
        # Parameters offloaded, optimizer not.
        cfg = base_config(train_micro_batch_size_per_gpu=BATCH // 2, zero_optimization={
            "stage": 3, "stage3_param_persistence_threshold": 0, "reduce_bucket_size": 40,
            "offload_param": {"device": device, "nvme_path": nvme_dir}})
        out[device + "_params_only"] = _train(rank, world, make_tied_model, cfg)
    import shardwise

    # With parameters on NVMe, no shard stays in memory between steps.
    cfg = _cfg(3, "nvme", nvme_dir)
    cfg["zero_optimization"]["offload_param"] = {"device": "nvme", "nvme_path": nvme_dir}
    model = make_tied_model()
    shardwise.zero.register_external_parameter(model, model.emb.weight)
    engine, *_ = shardwise.initialize(model=model, config=cfg)
    x, y = make_data(1, BATCH)
    engine.backward(mse(engine(x[0, :4]), y[0, :4]))
    engine.step()
    out["breakdown"] = engine.memory_breakdown().as_dict()
    return out


def test_stage3_parameter_offload_cpu_and_nvme_match_single_process(tmp_path):
    results = run_distributed(_param_offload_body, 2, args=(str(tmp_path / "nvme"),), timeout=300)
    ref_losses, ref_params = reference_training_for(make_tied_model(), STEPS, BATCH)
    for r in results:
        for device in ("cpu", "nvme", "cpu_params_only", "nvme_params_only"):
            losses, params = r[device]
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-6, atol=1e-7)
            for n in ref_params:
                torch.testing.assert_close(params[n], ref_params[n], rtol=1e-5, atol=1e-6, msg=f"{device}: {n}")
        m = r["breakdown"]
        assert m["params"] == 0 and m["master_params"] == 0 and m["optimizer_states"] == 0
        assert m["on_disk"] > 0 and m["live_params"] == 0


def _four_rank_body(rank, world, nvme_dir):
    out = {}
    for device in ("cpu", "nvme"):
        z = {"stage": 3, "stage3_param_persistence_threshold": 0, "reduce_bucket_size": 40, "sub_group_size": 60,
             "offload_optimizer": {"device": device, "nvme_path": nvme_dir, "buffer_count": 2},
             "offload_param": {"device": device, "nvme_path": nvme_dir}}
        cfg = base_config(train_micro_batch_size_per_gpu=BATCH // world // 2, gradient_accumulation_steps=2,
                          gradient_clipping=0.05, zero_optimization=z)
        out[device] = _train(rank, world, make_tied_model, cfg)
    return out


def test_stage3_full_offload_four_ranks_with_accumulation_and_clipping(tmp_path):
    results = run_distributed(_four_rank_body, 4, args=(str(tmp_path / "nvme"),), timeout=300)
    ref_losses, ref_params = reference_training_for(make_tied_model(), STEPS, BATCH, clip=0.05)
    for r in results:
        for device in ("cpu", "nvme"):
            losses, params = r[device]
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-6, atol=1e-7)
            for n in ref_params:
                torch.testing.assert_close(params[n], ref_params[n], rtol=1e-5, atol=1e-6, msg=f"{device}: {n}")
