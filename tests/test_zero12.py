"""ZeRO stages 1 and 2 reproduce single-process training (fp32, tight tolerance)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from distributed import run_distributed
from models import base_config, make_data, make_model, mse, reference_training, reference_training_for
from test_engine_dp import GLOBAL_BATCH, STEPS, _assert_close, _train_shardwise

# Tiny buckets: TinyMLP's parameters spread over several buckets, each padded to the world size.
ZERO = {"reduce_bucket_size": 40, "allgather_bucket_size": 60}


def _cases(world: int):
    micro = GLOBAL_BATCH // world
    for stage in (1, 2):
        z = {"stage": stage, **ZERO}
        yield f"s{stage}", base_config(train_micro_batch_size_per_gpu=micro, zero_optimization=z)
        yield f"s{stage}_clip", base_config(train_micro_batch_size_per_gpu=micro, gradient_clipping=0.05,
                                            zero_optimization=z)
        yield f"s{stage}_one_bucket", base_config(train_micro_batch_size_per_gpu=micro,
                                                  zero_optimization={"stage": stage})
        # "reduce_scatter": false reduces with all-reduce and keeps this rank's chunk.
        yield f"s{stage}_allreduce", base_config(train_micro_batch_size_per_gpu=micro,
                                                 zero_optimization={**z, "reduce_scatter": False})


def _body(rank: int, world: int):
    out = {name: _train_shardwise(rank, world, cfg) for name, cfg in _cases(world)}
    import shardwise

    engine, *_ = shardwise.initialize(model=make_model(), config=base_config(
        train_micro_batch_size_per_gpu=GLOBAL_BATCH // world, zero_optimization={"stage": 2, **ZERO}))
    owned = sum(t.numel() for t in engine.strategy.master_named_params().values())
    padded = sum(g.padded_numel for g in engine.strategy.groups)
    out["owned"] = (owned, padded)
    return out


def _check(results, world):
    ref = reference_training(STEPS, GLOBAL_BATCH)
    ref_clip = reference_training(STEPS, GLOBAL_BATCH, clip=0.05)
    for name in results[0]:
        if name == "owned":
            continue
        for r in results[1:]:
            _assert_close(results[0][name], r[name], exact=True)  # every replica identical
        _assert_close(results[0][name], ref_clip if name.endswith("clip") else ref)
    # Each rank owns 1/N of the (padded) optimizer partition.
    for r in results:
        owned, padded = r["owned"]
        assert owned <= padded // world and owned > 0


def test_stage1_and_stage2_match_single_process_two_ranks():
    _check(run_distributed(_body, 2, timeout=300), 2)


def test_stage1_and_stage2_match_single_process_four_ranks():
    _check(run_distributed(_body, 4, timeout=300), 4)


def _accum_body(rank: int, world: int):
    # Global batch 12 = world x micro-batch x accumulation 3.
    out = {}
    for stage in (1, 2):
        out[stage] = _train_shardwise(rank, world, base_config(
            train_micro_batch_size_per_gpu=12 // world // 3, gradient_accumulation_steps=3,
            zero_optimization={"stage": stage, **ZERO}), global_batch=12)
    return out


def test_accumulation_three_matches_single_process_two_and_four_ranks():
    ref = reference_training(STEPS, 12)
    for world in (2, 4):
        results = run_distributed(_accum_body, world, timeout=300)
        for stage in (1, 2):
            _assert_close(results[0][stage], ref)
            for r in results[1:]:
                _assert_close(results[0][stage], r[stage], exact=True)


def test_stage1_and_stage2_with_the_backends_own_collectives_two_ranks():
    """On gloo shardwise exchanges chunks point to point (shardwise.comm.direct); this runs
    gloo's own reduce-scatter and all-gather instead."""
    _check(run_distributed(_body, 2, timeout=300, env={"SHARDWISE_DIRECT_COLLECTIVES": "0"}), 2)


class BackwardsMLP(torch.nn.Module):
    """Layers registered in the opposite order to their use: gradients reach the buckets in the
    opposite order to the layout, so they arrive before their bucket has storage (and are copied)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.out = torch.nn.Linear(13, 3)
        self.fc2 = torch.nn.Linear(13, 13)
        self.fc1 = torch.nn.Linear(7, 13)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.fc2(torch.tanh(self.fc1(x)))))


def _train_watching_grads(rank: int, world: int, model: torch.nn.Module, zero: dict):
    """Stage-2 training that records, before each gradient is accumulated, whether ``param.grad``
    was already a view of bucket storage (autograd then writes in place), and whether any
    ``param.grad`` outlives backward."""
    import shardwise

    engine, *_ = shardwise.initialize(model=model, config=base_config(
        train_micro_batch_size_per_gpu=GLOBAL_BATCH // world, zero_optimization={"stage": 2, **zero}))
    trainable = [p for p in engine.module.parameters() if p.requires_grad]
    in_place = []
    for p in trainable:
        p.register_hook(lambda g, p=p: in_place.append(p.grad is not None))
    x, y = make_data(STEPS, GLOBAL_BATCH)
    per_rank = GLOBAL_BATCH // world
    losses, leftover = [], 0
    for s in range(STEPS):
        loss = mse(engine(x[s, rank * per_rank : (rank + 1) * per_rank]), y[s, rank * per_rank : (rank + 1) * per_rank])
        engine.backward(loss)
        leftover += sum(p.grad is not None for p in trainable)
        engine.step()
        loss = loss.detach()
        dist.all_reduce(loss)
        losses.append(loss.item() / world)
    params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    return {"run": (losses, params), "in_place": sum(in_place), "arrived": len(in_place), "leftover": leftover}


def _in_place_body(rank: int, world: int):
    out = {}
    for bucket_name, zero in (("one_bucket", {}), ("tiny_buckets", ZERO)):
        out["tiny", bucket_name] = _train_watching_grads(rank, world, make_model(), zero)
        out["backwards", bucket_name] = _train_watching_grads(rank, world, BackwardsMLP(), zero)
    return out


def test_stage2_gradients_land_in_bucket_storage_and_do_not_outlive_backward():
    results = run_distributed(_in_place_body, 2, timeout=300)
    ref_tiny = reference_training(STEPS, GLOBAL_BATCH)
    ref_backwards = reference_training_for(BackwardsMLP(), STEPS, GLOBAL_BATCH)
    for key, res in results[0].items():
        _assert_close(res["run"], ref_tiny if key[0] == "tiny" else ref_backwards)
        _assert_close(res["run"], results[1][key]["run"], exact=True)
        assert res["leftover"] == 0, f"{key}: param.grad kept after backward"
        assert res["arrived"] > 0
    # Layout order = autograd order: every gradient is accumulated straight into its bucket.
    for bucket_name in ("one_bucket", "tiny_buckets"):
        res = results[0]["tiny", bucket_name]
        assert res["in_place"] == res["arrived"], (bucket_name, res["in_place"], res["arrived"])
    assert results[0]["backwards", "one_bucket"]["in_place"] == results[0]["backwards", "one_bucket"]["arrived"]
    # The opposite order with small buckets: some gradients arrive first and take the copy path.
    res = results[0]["backwards", "tiny_buckets"]
    assert 0 < res["in_place"] < res["arrived"], (res["in_place"], res["arrived"])


def _groups(model: torch.nn.Module) -> list[dict]:
    """Two param groups with their own learning rate and weight decay (biases without decay)."""
    decay = [p for n, p in model.named_parameters() if p.requires_grad and n.endswith("weight")]
    no_decay = [p for n, p in model.named_parameters() if p.requires_grad and not n.endswith("weight")]
    return [{"params": decay, "lr": 2e-2, "weight_decay": 0.1}, {"params": no_decay, "lr": 5e-3, "weight_decay": 0.0}]


def _optimizer_cases():
    yield "client_adamw", lambda m: torch.optim.AdamW(_groups(m), lr=1e-2), None
    yield "client_sgd", lambda m: torch.optim.SGD(_groups(m), lr=1e-2, momentum=0.9), None
    yield "config_sgd", lambda m: torch.optim.SGD(_groups(m), lr=1e-2, momentum=0.9, nesterov=True), \
        {"type": "SGD", "params": {"lr": 1e-2, "momentum": 0.9, "nesterov": True}}


def _reference_with(make_opt) -> tuple[list[float], dict]:
    model = make_model()
    opt = make_opt(model)
    x, y = make_data(STEPS, GLOBAL_BATCH)
    losses = []
    for s in range(STEPS):
        loss = mse(model(x[s]), y[s])
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():  # the unused parameter steps with a zero gradient, as under ZeRO
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
        opt.step()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _optimizers_body(rank: int, world: int):
    import shardwise

    out = {}
    for stage in (1, 2):
        for name, make_opt, config_opt in _optimizer_cases():
            model = make_model()
            cfg = base_config(train_micro_batch_size_per_gpu=GLOBAL_BATCH // world,
                              zero_optimization={"stage": stage, **ZERO})
            if config_opt is None:  # a client optimizer over param groups
                del cfg["optimizer"]
                engine, opt, *_ = shardwise.initialize(model=model, optimizer=make_opt(model), config=cfg)
            else:  # the config's optimizer over param groups passed as model_parameters
                cfg["optimizer"] = config_opt
                engine, opt, *_ = shardwise.initialize(model=model, model_parameters=_groups(model), config=cfg)
            lrs = [(g["lr"], g["weight_decay"]) for g in opt.param_groups]
            x, y = make_data(STEPS, GLOBAL_BATCH)
            per = GLOBAL_BATCH // world
            losses = []
            for s in range(STEPS):
                loss = mse(engine(x[s, rank * per : (rank + 1) * per]), y[s, rank * per : (rank + 1) * per])
                engine.backward(loss)
                engine.step()
                loss = loss.detach()
                dist.all_reduce(loss)
                losses.append(loss.item() / world)
            out[stage, name] = {"run": (losses, {n: p.detach().clone() for n, p in engine.module.named_parameters()}),
                                "groups": lrs}
    return out


def test_client_and_config_optimizers_keep_their_param_groups_under_stages_1_and_2():
    results = run_distributed(_optimizers_body, 2, timeout=300)
    refs = {name: _reference_with(make_opt) for name, make_opt, _ in _optimizer_cases()}
    for (stage, name), res in results[0].items():
        assert res["groups"] == [(2e-2, 0.1), (5e-3, 0.0)], (stage, name, res["groups"])
        _assert_close(res["run"], refs[name])
        _assert_close(res["run"], results[1][stage, name]["run"], exact=True)
