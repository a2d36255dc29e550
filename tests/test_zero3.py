"""ZeRO stage 3: parity with single-process training, zero.Init, GatheredParameters."""

from __future__ import annotations

import resource

import torch

from distributed import run_distributed
from models import (base_config, make_data, make_model, make_tied_model, mse, reference_training_for)

STEPS, BATCH = 4, 8
Z3 = {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 200,
      "reduce_bucket_size": 50}


def _train(rank, world, make, cfg):
    import shardwise

    model = make()
    if hasattr(model, "emb"):
        shardwise.zero.register_external_parameter(model, model.emb.weight)
    engine, *_ = shardwise.initialize(model=model, config=cfg)
    x, y = make_data(STEPS, BATCH)
    micro, gas = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    per = BATCH // world
    losses = []
    for s in range(STEPS):
        xs, ys = x[s, rank * per:(rank + 1) * per], y[s, rank * per:(rank + 1) * per]
        total = 0.0
        for m in range(gas):
            loss = mse(engine(xs[m * micro:(m + 1) * micro]), ys[m * micro:(m + 1) * micro])
            engine.backward(loss)
            if s == 0 and m == gas - 1 and engine.zero_optimization_stage() == 3:  # (test_zero_offload: 1-3)
                _check_averaged_gradients(engine, model)
            engine.step()
            total += loss.item() / gas
        t = torch.tensor(total)
        torch.distributed.all_reduce(t)
        losses.append(t.item() / world)
    from shardwise.utils import safe_get_full_fp32_param

    params = {n: safe_get_full_fp32_param(p) for n, p in model.named_parameters()}
    return losses, params


def _check_averaged_gradients(engine, model):
    """DeepSpeed's ``engine.optimizer.averaged_gradients``: {0: this rank's zero-padded chunk of each reduced
    gradient (accumulated over the micro-steps)}, unit by unit; read before the step."""
    from shardwise.utils import safe_get_full_grad
    from shardwise.zero.partitioned_param import chunk_size, owned_range, unit_of

    engine.allreduce_gradients()  # DeepSpeed's call: backward reduced them already, nothing changes
    view = engine.optimizer.averaged_gradients
    trainable = sorted((p for p in model.parameters() if p.requires_grad),
                       key=lambda p: (unit_of(p).index, unit_of(p).position_of[id(p)]))
    assert list(view) == [0] and len(view[0]) == len(trainable)
    for p, got in zip(trainable, view[0]):
        full = safe_get_full_grad(p).reshape(-1)  # (collective: same order on every rank)
        start, end = owned_range(p)
        assert got.numel() == chunk_size(p) and not got[end - start:].any()
        assert torch.equal(got[: end - start], full[start:end])


def _cases(world):
    micro = BATCH // world
    yield "mlp", make_model, base_config(train_micro_batch_size_per_gpu=micro, zero_optimization=Z3)
    yield "tied", make_tied_model, base_config(train_micro_batch_size_per_gpu=micro, zero_optimization=Z3)
    yield "tied_clip_accum", make_tied_model, base_config(
        train_micro_batch_size_per_gpu=micro // 2, gradient_accumulation_steps=2, gradient_clipping=0.05,
        zero_optimization=Z3)
    yield "tied_persistent", make_tied_model, base_config(train_micro_batch_size_per_gpu=micro,
                                                          zero_optimization={"stage": 3})


def _parity_body(rank, world):
    return {name: _train(rank, world, make, cfg) for name, make, cfg in _cases(world)}


def _check(results, world):
    refs = {
        "mlp": reference_training_for(make_model(), STEPS, BATCH),
        "tied": reference_training_for(make_tied_model(), STEPS, BATCH),
        "tied_clip_accum": reference_training_for(make_tied_model(), STEPS, BATCH, clip=0.05),
        "tied_persistent": reference_training_for(make_tied_model(), STEPS, BATCH),
    }
    for name, (ref_losses, ref_params) in refs.items():
        for r in results:
            losses, params = r[name]
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-6, atol=1e-7)
            assert params.keys() == ref_params.keys()
            for n in params:
                torch.testing.assert_close(params[n], ref_params[n], rtol=1e-5, atol=1e-6, msg=f"{name}: {n}")


def test_stage3_matches_single_process_two_ranks():
    _check(run_distributed(_parity_body, 2, timeout=300), 2)


def test_stage3_with_the_backends_own_collectives_two_ranks():
    """On gloo shardwise exchanges chunks point to point (shardwise.comm.direct); this runs
    gloo's own reduce-scatter and all-gather instead."""
    _check(run_distributed(_parity_body, 2, timeout=300, env={"SHARDWISE_DIRECT_COLLECTIVES": "0"}), 2)


def test_stage3_matches_single_process_four_ranks():
    _check(run_distributed(_parity_body, 4, timeout=300), 4)


def _gathered_body(rank, world):
    import shardwise

    model = make_model()
    engine, *_ = shardwise.initialize(model=model, config=base_config(zero_optimization=Z3))
    shard_numel = model.fc1.weight.ds_tensor.numel()
    with shardwise.zero.GatheredParameters(model.fc1.weight, modifier_rank=0):
        whole = model.fc1.weight.shape
        if rank == 0:
            model.fc1.weight.data.fill_(0.5)
    from shardwise.utils import safe_get_full_fp32_param

    w = safe_get_full_fp32_param(model.fc1.weight)
    x, _ = make_data(1, 4)
    out = engine(x[0]).detach()
    return tuple(whole), shard_numel, bool((w == 0.5).all()), out


def test_gathered_parameters_modifier_rank_updates_every_rank():
    results = run_distributed(_gathered_body, 2, timeout=120)
    for whole, shard_numel, ok, _ in results:
        assert whole == (13, 7) and shard_numel == -(-91 // 2) and ok
    ref = make_model()
    with torch.no_grad():
        ref.fc1.weight.fill_(0.5)
    x, _ = make_data(1, 4)
    torch.testing.assert_close(results[0][3], ref(x[0]).detach())
    torch.testing.assert_close(results[1][3], results[0][3])


LAYERS, WIDTH = 16, 1024


def _init_body(rank, world):
    import shardwise

    shardwise.init_distributed()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    with shardwise.zero.Init():
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])
        model.apply(lambda m: torch.nn.init.constant_(m.bias, 0.25) if isinstance(m, torch.nn.Linear) else None)
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    shard_bytes = sum(p.ds_tensor.nbytes for p in model.parameters())
    empty = all(p.numel() == 0 for p in model.parameters())
    engine, *_ = shardwise.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0,
        "optimizer": {"type": "SGD", "params": {"lr": 0.01}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}})
    x = torch.randn(2, WIDTH)
    losses = []
    for _ in range(3):
        loss = engine(x).pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    from shardwise.utils import safe_get_full_fp32_param

    bias_ok = bool(torch.allclose(safe_get_full_fp32_param(model[0].bias), torch.full((WIDTH,), 0.25), atol=0.05))
    return grown, shard_bytes, empty, losses, bias_ok


def test_zero_init_never_materialises_the_model_and_trains():
    full_bytes = LAYERS * (WIDTH * WIDTH + WIDTH) * 4
    # (fresh interpreters: the peak resident memory measured is this model's, not a fork server's preload)
    for grown, shard_bytes, empty, losses, bias_ok in run_distributed(_init_body, 2, timeout=300, fresh_interpreter=True):
        assert empty, "parameters should hold no data outside forward"
        assert abs(shard_bytes - full_bytes / 2) < 0.01 * full_bytes
        # Peak resident memory grew by about the shards plus one layer, far below the whole model.
        assert grown < 0.75 * full_bytes, (grown, full_bytes)
        assert losses[-1] < losses[0]
        assert bias_ok, "model.apply(init) inside zero.Init must reach the shards"


def _save16_body(rank, world, out_dir):
    import shardwise

    results = {}
    for stage, gather in ((0, False), (3, False), (3, True)):
        z = {"stage": stage, "stage3_param_persistence_threshold": 0,
             "stage3_gather_16bit_weights_on_model_save": gather}
        engine, *_ = shardwise.initialize(model=make_model(), config=base_config(
            bf16={"enabled": True}, zero_optimization=z))
        results[(stage, gather)] = engine.save_16bit_model(f"{out_dir}/s{stage}{gather}")
    return results


def test_save_16bit_model_gathers_stage3_weights(tmp_path):
    from safetensors.torch import load_file

    (r0, r1) = run_distributed(_save16_body, 2, args=(str(tmp_path),), timeout=180)
    assert r0 == r1 == {(0, False): True, (3, False): False, (3, True): True}
    ref = {k: v.to(torch.bfloat16) for k, v in make_model().state_dict().items()}
    for folder in ("s0False", "s3True"):
        saved = load_file(str(tmp_path / folder / "model.safetensors"))
        assert saved.keys() == ref.keys()
        for k in ref:
            assert saved[k].dtype == torch.bfloat16 and torch.equal(saved[k], ref[k]), (folder, k)
    assert not (tmp_path / "s3False").exists()


def test_units_follow_the_module_tree():
    """Units: whole subtrees up to stage3_prefetch_bucket_size elements; ModuleList is descended."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples", "gpt"))
    from model import GPT, GPTConfig

    from shardwise.zero.partitioned_param import shard_param_
    from shardwise.zero.stage3 import _build_units

    import shardwise

    shardwise.init_distributed()
    model = GPT(GPTConfig())
    names = {id(p): n for n, p in model.named_parameters()}
    for p in model.parameters():
        shard_param_(p)
    block = sum(p.ds_numel for p in model.blocks[0].parameters())
    units, module_units = _build_units(model, names, block)
    roots = {m for m, us in module_units.items()}
    assert all(b in roots for b in model.blocks) and model.blocks not in roots and model not in roots
    assert len(units) == 4 + 4  # tok, pos, 4 blocks, ln_f, head
    assert sorted(u.full_numel for u in units if "blocks.0." in u.names[0]) == [block]


def _held_data_body(rank, world, out_dir):
    """DeepSpeed-Chat's ``save_zero_three_model``: ``v.data.cpu()`` taken inside GatheredParameters
    (only for released parameters; available ones as they are), kept, saved after training goes on."""
    import shardwise
    from shardwise.utils import safe_get_full_fp32_param
    from shardwise.zero import GatheredParameters, ZeroParamStatus

    x, y = make_data(3, 4)
    out = {}
    for persist in (0, 10**5):  # every unit released after use / every unit persistent (stays gathered)
        z = {"stage": 3, "stage3_param_persistence_threshold": persist}
        model = make_model()
        engine, *_ = shardwise.initialize(model=model, config=base_config(zero_optimization=z))
        engine.backward(mse(engine(x[0]), y[0]))
        engine.step()
        with torch.no_grad():
            engine(x[1])  # (an eval forward: persistent units stay gathered after it)
        held, expect = {}, {}
        for k, v in model.named_parameters():
            released = [v] if v.ds_status == ZeroParamStatus.NOT_AVAILABLE else []
            with GatheredParameters(released):
                held[k] = v.data.cpu()
            expect[k] = safe_get_full_fp32_param(v).clone()
        for s in (1, 2):  # training goes on before the file is written
            engine.backward(mse(engine(x[s]), y[s]))
            engine.step()
            with torch.no_grad():
                engine(x[s])
        now = {k: safe_get_full_fp32_param(p) for k, p in model.named_parameters()}  # (collective)
        # a forward (with autograd) inside GatheredParameters leaves the block's own copies in .data
        with GatheredParameters(list(model.parameters()), modifier_rank=0):
            model.fc1.bias.data.fill_(0.25)
            mse(engine(x[0]), y[0]).backward()  # (plain backward: nothing reduced or stepped)
            kept = bool((model.fc1.bias.data == 0.25).all()) and model.fc1.bias.shape == (13,)
        out[persist, "kept"] = kept and bool((safe_get_full_fp32_param(model.fc1.bias) == 0.25).all())
        if rank == 0:
            torch.save(held, f"{out_dir}/p{persist}.bin")
            loaded = torch.load(f"{out_dir}/p{persist}.bin")
            out[persist] = all(torch.equal(loaded[k], expect[k]) for k in expect)
            out[persist, "moved"] = all(not torch.equal(expect[k], now[k]) for k in expect if "." in k)
    return out


def test_tensors_taken_from_gathered_params_stay_valid(tmp_path):
    r0, _ = run_distributed(_held_data_body, 2, args=(str(tmp_path),), timeout=180)
    assert r0 == {0: True, (0, "moved"): True, (0, "kept"): True, 10**5: True, (10**5, "moved"): True,
                  (10**5, "kept"): True}, r0
