"""The training blocks ``timers``, ``torch_autocast`` and ``data_types.grad_accum_dtype``."""

from __future__ import annotations

import pytest
import torch

from models import base_config, make_data, make_model, mse


# ---------------------------------------------------------------- timers

@pytest.mark.parametrize("enabled", [True, False])
def test_timers_throughput_switches_the_tput_timer(enabled):
    import shardwise

    cfg = base_config(timers={"throughput": {"enabled": enabled, "synchronized": False}})
    engine, _, _, _ = shardwise.initialize(model=make_model(), config=cfg)
    assert engine.config.timers.throughput.synchronized is False
    x, y = make_data(4, 4)
    for s in range(4):
        engine.backward(mse(engine(x[s]), y[s]))
        engine.step()
    timer = engine.tput_timer
    assert timer.enabled is enabled
    assert timer.global_step_count == (4 if enabled else 0)
    assert (timer.avg_samples_per_sec() > 0) is enabled  # -inf when off, as DeepSpeed's


def test_timers_defaults_and_unknown_key():
    from shardwise.config import ConfigError, load_config

    cfg = load_config({})
    assert cfg.timers.throughput.enabled is True and cfg.timers.throughput.synchronized is True
    with pytest.raises(ConfigError, match="timers.throughput.synchronised"):
        load_config({"timers": {"throughput": {"synchronised": True}}})


# ---------------------------------------------------------------- torch_autocast / grad_accum_dtype

_DT = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
GAS, STEPS, MICRO = 2, 2, 3


def _data(world: int):
    return make_data(STEPS * GAS, world * MICRO)


def _reference(*, world: int, stage: int, model_dtype="fp32", accum=None, autocast=None, loss_scale=1.0):
    """Hand-written torch training of ``make_model()``: fp32 masters stepped by AdamW, the model in
    ``model_dtype``, each micro-step's gradient accumulated in ``accum`` (default: the model's dtype).
    Stages 0-1 accumulate each rank's gradient locally and average at the boundary; stages 2-3 average
    every micro-step and accumulate the average (DeepSpeed's order), each in the dtype the stage holds."""
    from models import make_model, mse
    from shardwise.optim import build_optimizer

    model = make_model()
    params = [p for p in model.parameters() if p.requires_grad]
    pdt, adt = _DT[model_dtype], _DT[accum or model_dtype]
    # stage 3 builds its fp32 masters from the 16-bit shards (as DeepSpeed, which casts the model first);
    # stages 0-2 from the fp32 weights
    masters = [(p.detach().to(pdt) if stage == 3 else p.detach()).float().requires_grad_() for p in params]
    opt = build_optimizer("AdamW", {"lr": 1e-2, "weight_decay": 0.01}, masters)
    for p in model.parameters():
        p.data = p.data.to(pdt)
    x, y = _data(world)

    def grads_of(s, r):
        xs = x[s, r * MICRO:(r + 1) * MICRO].to(pdt)
        with torch.autocast("cpu", dtype=_DT[autocast]) if autocast else torch.autocast("cpu", enabled=False):
            out = model(xs)
        loss = mse(out, y[s, r * MICRO:(r + 1) * MICRO]) / GAS * loss_scale
        gs = torch.autograd.grad(loss, params, allow_unused=True)
        return [torch.zeros_like(p) if g is None else g for p, g in zip(params, gs)]

    def average(per_rank):  # all-reduce (sum) then times 1/world, in the tensors' dtype
        if world == 1:
            return per_rank[0]
        total = [_sum(gs) for gs in zip(*per_rank)]
        return [t.mul_(1.0 / world) for t in total]

    for step in range(STEPS):
        local = [[torch.zeros_like(p, dtype=adt) for p in params] for _ in range(world)]
        acc = [torch.zeros_like(p, dtype=adt) for p in params]
        for m in range(GAS):
            s = step * GAS + m
            per_rank = [grads_of(s, r) for r in range(world)]
            if stage <= 1:
                for r in range(world):
                    for a, g in zip(local[r], per_rank[r]):
                        a.add_(g)
            else:
                for a, g in zip(acc, average(per_rank)):
                    a.add_(g)
        if stage <= 1:
            acc = average(local)
        for mp, a in zip(masters, acc):
            mp.grad = a.float() * (1.0 / loss_scale) if loss_scale != 1.0 else a.float()
        opt.step()
        with torch.no_grad():
            for p, mp in zip(params, masters):
                p.copy_(mp)
    return {n: p.detach().float() for n, p in model.named_parameters()}


def _sum(tensors):
    out = tensors[0].clone()
    for t in tensors[1:]:
        out.add_(t)
    return out


def _engine_run(rank: int, world: int, *, stage: int, model_dtype="fp32", accum=None, autocast=None,
                loss_scale_power=None):
    import shardwise

    cfg = base_config(gradient_accumulation_steps=GAS, train_micro_batch_size_per_gpu=MICRO,
                      zero_optimization={"stage": stage, "reduce_bucket_size": 40})
    if model_dtype != "fp32":
        cfg[model_dtype] = {"enabled": True}
    if accum:
        cfg["data_types"] = {"grad_accum_dtype": accum}
    if autocast:
        cfg["torch_autocast"] = {"enabled": True, "dtype": autocast}
    if loss_scale_power is not None:
        cfg["fp16"] = {"enabled": False, "initial_scale_power": loss_scale_power}
    engine, _, _, _ = shardwise.initialize(model=make_model(), config=cfg)
    x, y = _data(world)
    for s in range(STEPS * GAS):
        xs = x[s, rank * MICRO:(rank + 1) * MICRO].to(_DT[model_dtype])
        engine.backward(mse(engine(xs), y[s, rank * MICRO:(rank + 1) * MICRO]))
        engine.step()
    state = engine.module_state_dict()
    return {n: t.detach().float() for n, t in state.items()}


CASES = [  # (model dtype, grad_accum_dtype, torch_autocast dtype); bf16 with bf16 accumulation is
    ("fp32", None, "bf16"),  # plain bf16 training, tested elsewhere (test_engine_mixed_precision.py)
    ("fp32", "bf16", None),
    ("bf16", "fp32", None),
]
TWO_RANK_CASES = [CASES[0], CASES[2]]  # (fp32 weights with bf16 accumulation: world 1 above)


def _assert_same(got, want, what, atol=0.0):
    for name, w in want.items():
        torch.testing.assert_close(got[name], w, rtol=1e-6, atol=atol, msg=lambda m: f"{what} {name}: {m}")


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_autocast_and_accum_dtype_match_a_torch_reference_world_1(stage):
    for model_dtype, accum, autocast in CASES:
        got = _engine_run(0, 1, stage=stage, model_dtype=model_dtype, accum=accum, autocast=autocast)
        want = _reference(world=1, stage=stage, model_dtype=model_dtype, accum=accum, autocast=autocast)
        _assert_same(got, want, f"stage {stage} {model_dtype}/{accum}/{autocast}:")
    # the settings change the numbers (so the comparisons above can fail)
    plain = _reference(world=1, stage=stage)
    assert not torch.equal(_reference(world=1, stage=stage, accum="bf16")["fc1.weight"], plain["fc1.weight"])
    assert not torch.equal(_reference(world=1, stage=stage, autocast="bf16")["fc1.weight"], plain["fc1.weight"])
    bf16 = _reference(world=1, stage=stage, model_dtype="bf16")
    assert not torch.equal(_reference(world=1, stage=stage, model_dtype="bf16", accum="fp32")["fc1.weight"],
                           bf16["fc1.weight"])


def test_autocast_fp16_scales_the_loss_and_marks_safe_modules():
    """fp16 autocast gets dynamic loss scaling (DeepSpeed: a GradScaler), here a scale of 2**4 that
    the reference applies too; the listed module classes' parameters carry DeepSpeed's comm_dtype."""
    import shardwise

    got = _engine_run(0, 1, stage=0, autocast="fp16", loss_scale_power=4)
    _assert_same(got, _reference(world=1, stage=0, autocast="fp16", loss_scale=16.0), "fp16 autocast:")

    cfg = base_config(torch_autocast={"enabled": True, "dtype": "bfloat16",
                                      "lower_precision_safe_modules": ["torch.nn.Linear"]})
    engine, _, _, _ = shardwise.initialize(model=make_model(), config=cfg)
    assert engine.torch_autocast_enabled() and engine.torch_autocast_dtype() == torch.bfloat16
    marked = {n for n, p in engine.module.named_parameters() if getattr(p, "comm_dtype", None) == torch.bfloat16}
    assert marked == {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias", "out.weight", "out.bias"}
    for bad, why in [("torch.nn.Linaer", "cannot import"), ("torch.float32", "not a torch.nn.Module")]:
        cfg["torch_autocast"]["lower_precision_safe_modules"] = [bad]
        with pytest.raises(ValueError, match=f"torch_autocast.lower_precision_safe_modules: .*{why}"):
            shardwise.initialize(model=make_model(), config=cfg)


def _two_rank_body(rank: int, world: int):
    return {(stage, *case): _engine_run(rank, world, stage=stage, model_dtype=case[0], accum=case[1],
                                        autocast=case[2])
            for stage in (0, 1, 2, 3) for case in TWO_RANK_CASES}


def test_autocast_and_accum_dtype_match_a_torch_reference_two_ranks():
    from distributed import run_distributed

    results = run_distributed(_two_rank_body, 2, timeout=300)
    for (stage, model_dtype, accum, autocast), got in results[0].items():
        want = _reference(world=2, stage=stage, model_dtype=model_dtype, accum=accum, autocast=autocast)
        # (atol: a reduce-scatter may sum in another order than the all-reduce the reference mimics)
        _assert_same(got, want, f"2 ranks, stage {stage} {model_dtype}/{accum}/{autocast}:", atol=1e-8)
        _assert_same(results[1][(stage, model_dtype, accum, autocast)], got, "rank 1 vs rank 0:")


def test_autocast_in_a_pipeline_matches_a_torch_reference():
    """The pipeline engine runs its stages' forward under the block's autocast too (world 1, 1 stage)."""
    import shardwise
    from pipe_models import batch, layer_specs
    from shardwise.pipe import PipelineModule

    micro, rows, steps = 2, 3, 2
    shardwise.init_distributed()  # (a world of one when no launcher set it up)
    model = PipelineModule(layer_specs(), num_stages=1, loss_fn=torch.nn.CrossEntropyLoss(), seed_layers=True)
    cfg = {"train_micro_batch_size_per_gpu": rows, "gradient_accumulation_steps": micro, "gradient_clipping": 0.0,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
           "torch_autocast": {"enabled": True, "dtype": "bf16"}}
    engine, *_ = shardwise.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    got = []
    for step in range(steps):
        x, y = batch(step, micro, rows)
        got.append(float(engine.train_batch(iter([(x[i], y[i]) for i in range(micro)]))))

    want, plain = (_sequential_losses(micro, rows, steps, autocast=a) for a in (True, False))
    assert got == pytest.approx(want, rel=1e-6)
    assert want != pytest.approx(plain, rel=1e-4)  # autocast changes the numbers


def _sequential_losses(micro, rows, steps, *, autocast):
    from pipe_models import batch, layer_specs
    from shardwise.optim import build_optimizer
    from shardwise.pipe.module import build_sequential

    ref = build_sequential(layer_specs(), seed_layers=True)
    opt = build_optimizer("AdamW", {"lr": 1e-2, "weight_decay": 0.01}, ref.parameters())
    losses = []
    for step in range(steps):
        x, y = batch(step, micro, rows)
        opt.zero_grad()
        total = 0.0
        for i in range(micro):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                out = ref(x[i])
            loss = torch.nn.functional.cross_entropy(out, y[i])
            (loss / micro).backward()
            total += float(loss.detach())
        opt.step()
        losses.append(total / micro)
    return losses
