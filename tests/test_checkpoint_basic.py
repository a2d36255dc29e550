"""DeepSpeed's save/load options (tag validation, save_latest, load_module_only,
load_optimizer_states, load_lr_scheduler_states, exclude_frozen_parameters) and tied weights
(one tensor under two names) at stages 0 and 3.  Exact resume: test_checkpoint_resume.py;
resharding: test_checkpoint_reshard.py; errors: test_checkpoint_errors.py."""

from __future__ import annotations

import json
import os

import torch

from ckpt_common import full_params
from distributed import run_distributed
from models import base_config, make_data, make_model, make_tied_model, mse

SCHED = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2, "warmup_num_steps": 10}}


def _trained(make, stage, rank, steps=2, **extra):
    import shardwise

    cfg = base_config(scheduler=SCHED, zero_optimization={"stage": stage, "reduce_bucket_size": 40,
                                                          "stage3_param_persistence_threshold": 0}, **extra)
    engine, *_ = shardwise.initialize(model=make(), config=cfg)
    x, y = make_data(steps, 8)
    for s in range(steps):
        engine.backward(mse(engine(x[s, rank * 4 : (rank + 1) * 4]), y[s, rank * 4 : (rank + 1) * 4]))
        engine.step()
    return engine, cfg


def _fresh(make, cfg):
    import shardwise

    return shardwise.initialize(model=make(seed=9), config=cfg)[0]


def _options_body(rank, world, root):
    out = {}
    engine, cfg = _trained(make_model, 1, rank, checkpoint={"tag_validation": "Fail"})
    try:
        engine.save_checkpoint(root, tag=f"rank{rank}")
        out["tags"] = "saved"
    except ValueError as e:  # also an AssertionError, as DeepSpeed raises
        out["tags"] = str(e) + (" [AssertionError]" if isinstance(e, AssertionError) else "")
    engine.save_checkpoint(root, tag="full")
    engine.save_checkpoint(root, tag="side", save_latest=False)
    engine.save_checkpoint(root, tag="nofrozen", exclude_frozen_parameters=True, save_latest=False)
    out["saved"] = full_params(engine)
    out["lr"] = engine.get_lr()

    only = _fresh(make_model, cfg)
    only.load_checkpoint(root, load_module_only=True)
    out["module_only"] = (full_params(only), only.global_steps, len(only.optimizer.state), only.get_lr())
    no_opt = _fresh(make_model, cfg)
    no_opt.load_checkpoint(root, load_optimizer_states=False, load_lr_scheduler_states=False)
    out["no_opt"] = (no_opt.global_steps, len(no_opt.optimizer.state), no_opt.get_lr())
    strict = _fresh(make_model, cfg)
    try:
        strict.load_checkpoint(root, tag="nofrozen")
        out["nofrozen_strict"] = "loaded"
    except ValueError as e:
        out["nofrozen_strict"] = str(e)
    lenient = _fresh(make_model, cfg)
    lenient.load_checkpoint(root, tag="nofrozen", load_module_strict=False)
    out["nofrozen"] = (full_params(lenient), full_params(_fresh(make_model, cfg))["frozen"])
    return out


def _body(rank, world, root):  # one group of processes for both checks: spawning is the slow part
    options = _options_body(rank, world, os.path.join(root, "options"))
    return options, _tied_body(rank, world, os.path.join(root, "tied"))


def test_save_load_options_and_tied_weights(tmp_path):
    results = run_distributed(_body, 2, args=(str(tmp_path),), timeout=240)
    _check_options([r[0] for r in results], tmp_path / "options")
    _check_tied([r[1] for r in results], tmp_path / "tied")


def _check_options(results, tmp_path):
    for r in results:
        assert "ranks were given different tags ['rank0', 'rank1']" in r["tags"] and "'Fail'" in r["tags"]
        assert r["tags"].endswith("[AssertionError]")
        params, steps, n_state, lr = r["module_only"]
        assert all(torch.equal(params[n], v) for n, v in r["saved"].items())
        assert steps == 0 and n_state == 0 and lr != r["lr"], "load_module_only restores the weights only"
        steps, n_state, lr = r["no_opt"]
        assert steps == 2 and n_state == 0 and lr != r["lr"]
        assert "missing in checkpoint: frozen" in r["nofrozen_strict"]
        params, own_frozen = r["nofrozen"]
        assert torch.equal(params["frozen"], own_frozen)
        assert all(torch.equal(params[n], v) for n, v in r["saved"].items() if n != "frozen")
    assert (tmp_path / "latest").read_text() == "full"
    assert not (tmp_path / "rank0").exists() and not (tmp_path / "rank1").exists()


def _tied_body(rank, world, root):
    out = {}
    for stage in (0, 3):
        engine, cfg = _trained(make_tied_model, stage, rank)
        engine.save_checkpoint(os.path.join(root, f"s{stage}"))
        fresh = _fresh(make_tied_model, cfg)
        fresh.load_checkpoint(os.path.join(root, f"s{stage}"))
        out[stage] = (full_params(engine), full_params(fresh),
                      fresh.module.proj2.weight is fresh.module.proj.weight)
    return out


def _check_tied(results, tmp_path):
    from safetensors import safe_open

    from shardwise.checkpoint import get_fp32_state_dict_from_checkpoint

    for stage in (0, 3):
        for saved, loaded, still_tied in (r[stage] for r in results):
            assert saved.keys() == loaded.keys()
            assert all(torch.equal(loaded[n], v) for n, v in saved.items()), f"stage {stage}"
            assert still_tied
        folder = tmp_path / f"s{stage}" / "global_step2"
        manifest = json.loads((folder / "manifest.json").read_text())
        assert manifest["aliases"] == {"proj2.weight": "proj.weight"}
        with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
            assert "proj.weight" in f.keys() and "proj2.weight" not in f.keys()
        full = get_fp32_state_dict_from_checkpoint(tmp_path / f"s{stage}")
        assert torch.equal(full["proj2.weight"], full["proj.weight"])
        assert torch.equal(full["proj.weight"], results[0][stage][0]["proj.weight"])
