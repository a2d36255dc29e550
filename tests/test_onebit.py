"""OneBitAdam, ZeroOneAdam and OneBitLamb through the engine, at 2 ranks (one spawn) and 1 rank.

* warm-up: losses and weights equal plain Adam's / Lamb's bit for bit;
* after warm-up: the engine stops its gradient all-reduce, the compressed exchange moves >= 5x fewer
  bytes, and a toy regression ends within 1.5x of Adam's final loss;
* checkpoints: bitwise resume after warm-up (error buffers, frozen variance, ZeroOneAdam's local
  state), and a clear refusal to load those per-rank buffers at another world size;
* OneBitAdam at ZeRO stage 1: stage 0's losses and weights bit for bit, fp32, bf16 and fp16, and resume;
* refusals: ZeRO stages 2-3 (stage 1 for the other two types), a comm_backend_name that is not the
  process group's.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from distributed import run_distributed, run_subtests
from models import make_model, mse

STEPS = 40
GLOBAL_BATCH = 16


def _data(steps: int, seed: int = 3):
    """A learnable regression: a fixed random teacher network plus a little noise."""
    g = torch.Generator().manual_seed(seed)
    a, b = torch.randn(7, 11, generator=g), torch.randn(11, 3, generator=g) / 3
    x = torch.randn(steps, GLOBAL_BATCH, 7, generator=g)
    y = torch.tanh(x @ a) @ b + 0.01 * torch.randn(steps, GLOBAL_BATCH, 3, generator=g)
    return x, y


def _config(opt_type: str, params: dict, **extra) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": GLOBAL_BATCH // int(os.environ["WORLD_SIZE"]),
           "gradient_clipping": 0.0,
           "optimizer": {"type": opt_type, "params": {"lr": 1e-2, "weight_decay": 0.01, **params}},
           "zero_optimization": {"stage": 0}}
    cfg.update(extra)
    return cfg


def _train(engine, steps: int, start: int = 0, data=None):
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = data if data is not None else _data(STEPS)
    per = GLOBAL_BATCH // world
    losses = []
    for s in range(start, start + steps):
        loss = mse(engine(x[s, rank * per : (rank + 1) * per]), y[s, rank * per : (rank + 1) * per])
        engine.backward(loss)
        engine.step()
        t = loss.detach().clone()
        dist.all_reduce(t)
        losses.append(t.item() / world)
    return losses


def _engine(cfg: dict):
    import shardwise

    model = make_model()
    engine, opt, _, _ = shardwise.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    return engine, opt


def _params(engine):
    return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def _same_on_all_ranks(params: dict) -> bool:
    flat = torch.cat([p.reshape(-1) for p in params.values()])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    return all(torch.equal(g, flat) for g in gathered)


# ----------------------------------------------------------------------------- 2-rank cases

WARMUP = [("OneBitAdam", {"freeze_step": 8}, "Adam", {}),
          ("ZeroOneAdam", {"var_freeze_step": 100, "var_update_scaler": 8}, "Adam", {}),
          ("OneBitLamb", {"freeze_step": 8}, "Lamb", {})]


def _warmup_case(case):
    onebit, params, plain, plain_params = case
    ref, _ = _engine(_config(plain, plain_params))
    want = _train(ref, 8)
    got_engine, opt = _engine(_config(onebit, params))
    got = _train(got_engine, 8)
    assert got == want, (onebit, got, want)
    pa, pb = _params(got_engine), _params(ref)
    assert all(torch.equal(pa[n], pb[n]) for n in pa), onebit
    assert not opt.needs_gradient_allreduce  # warm-up is over: the next step exchanges 1-bit messages
    return onebit


AFTER = [("Adam", {}),
         ("OneBitAdam", {"freeze_step": 10}),
         ("ZeroOneAdam", {"var_freeze_step": 16, "var_update_scaler": 4, "local_step_scaler": 6,
                          "local_step_clipper": 4}),
         ("OneBitLamb", {"freeze_step": 10, "lr": 0.05}),
         ("Lamb", {"lr": 0.05})]  # LAMB's own reference: on this toy it is slower than Adam at any lr


def _bytes_per_step(summary: dict) -> dict:
    return {op: sum(size * s["count"] for size, s in sizes.items()) for op, sizes in summary.items()}


def _after_warmup_case(case):
    from shardwise import comm

    opt_type, params = case
    cfg = _config(opt_type, params, comms_logger={"enabled": True})
    engine, opt = _engine(cfg)
    losses = _train(engine, 30)
    comm.reset_comms_log()
    losses += _train(engine, STEPS - 30, start=30)  # all past warm-up (ZeroOneAdam: local steps)
    moved = _bytes_per_step(comm.comms_summary())
    if opt_type not in ("Adam", "Lamb"):
        assert not opt.needs_gradient_allreduce
        assert moved.get("all_reduce", 0) == 0, moved  # no full-precision gradient all-reduce any more
        assert moved.get("compressed_all_to_all", 0) > 0 and moved.get("compressed_all_gather", 0) > 0
    return opt_type, losses, moved, _same_on_all_ranks(_params(engine))


def _resume_case(case, tmp: str):
    """Save past warm-up, keep training; a fresh engine loads and repeats the same steps bitwise."""
    opt_type, params = case
    cfg = _config(opt_type, params)
    engine, _ = _engine(cfg)
    _train(engine, 20)
    path = os.path.join(tmp, opt_type)
    engine.save_checkpoint(path, tag="s20")
    want = _train(engine, 8, start=20)
    want_params = _params(engine)

    fresh, opt = _engine(cfg)
    fresh.load_checkpoint(path, tag="s20")
    assert opt.rank_state_dict(), "the error buffers came back"
    got = _train(fresh, 8, start=20)
    assert got == want, (opt_type, got, want)
    got_params = _params(fresh)
    assert all(torch.equal(got_params[n], want_params[n]) for n in got_params), opt_type
    return opt_type


def _overflow_on_one_rank():
    """fp16 past warm-up (local gradients): an inf on rank 1 alone makes both ranks skip the step."""
    engine, opt = _engine(_config("OneBitAdam", {"freeze_step": 3}, fp16={"enabled": True}))
    x, y = _data(STEPS)
    x, y = x.half(), y.half()
    _train(engine, 5, data=(x, y))
    assert not opt.needs_gradient_allreduce
    before = _params(engine)
    if dist.get_rank() == 1:
        x[5, GLOBAL_BATCH // 2] = float("inf")
    _train(engine, 1, start=5, data=(x, y))
    assert engine.skipped_steps == 1 and engine.was_step_skipped()
    after = _params(engine)
    assert all(torch.equal(before[n], after[n]) for n in before)
    _train(engine, 2, start=6, data=(x, y))  # and training goes on, in step
    assert engine.skipped_steps == 1 and _same_on_all_ranks(_params(engine))


def _two_rank_body(rank: int, world: int, tmp: str):
    torch.use_deterministic_algorithms(True)
    warm = run_subtests(_warmup_case, WARMUP)
    after = run_subtests(_after_warmup_case, AFTER)
    resumed = run_subtests(_resume_case, AFTER[1:4], tmp)
    _overflow_on_one_rank()
    return {"warm": warm, "after": after, "resumed": resumed, "overflow": "agreed"}


def _one_rank_body(rank: int, world: int, tmp: str):
    import shardwise

    errors = {}
    # the 2-rank checkpoints hold per-rank error buffers: refused at 1 rank, with the reason
    for opt_type, params in AFTER[1:4]:
        engine, _ = _engine(_config(opt_type, params))
        try:
            engine.load_checkpoint(os.path.join(tmp, opt_type), tag="s20")
        except ValueError as e:
            errors[opt_type] = str(e)
        # weights only: fine
        engine.load_checkpoint(os.path.join(tmp, opt_type), tag="s20", load_optimizer_states=False)
    for stage in (1, 2, 3):
        model = make_model()
        try:
            shardwise.initialize(model=model, model_parameters=model.parameters(),
                                 config=_config("OneBitAdam", {}, zero_optimization={"stage": stage}))
        except ValueError as e:
            errors[f"stage{stage}"] = str(e)
    model = make_model()
    try:
        shardwise.initialize(model=model, model_parameters=model.parameters(),
                             config=_config("OneBitLamb", {"comm_backend_name": "nccl"}))
    except ValueError as e:
        errors["nccl"] = str(e)
    return errors


# ----------------------------------------------------------------------------- OneBitAdam at ZeRO stage 1

def _zero1_run(stage: int, precision: dict, steps: int, comms: bool = False):
    from shardwise import comm

    cfg = _config("OneBitAdam", {"freeze_step": 8}, zero_optimization={"stage": stage},
                  comms_logger={"enabled": comms}, **precision)
    engine, opt = _engine(cfg)
    x, y = _data(STEPS)
    if precision:
        dtype = torch.bfloat16 if "bf16" in precision else torch.float16
        x, y = x.to(dtype), y.to(dtype)
    losses = _train(engine, 12, data=(x, y))
    comm.reset_comms_log()
    losses += _train(engine, steps - 12, start=12, data=(x, y))  # past warm-up and the first compressed step
    return engine, opt, losses, _bytes_per_step(comm.comms_summary())


def _zero1_case(precision: dict):
    """Stage 1 gives stage 0's losses and weights bit for bit, with partitioned state and 1-bit traffic only."""
    ref, _, want, _ = _zero1_run(0, precision, 20)
    engine, opt, got, moved = _zero1_run(1, precision, 20, comms=True)
    assert got == want, (precision, got, want)
    pa, pb = _params(engine), _params(ref)
    assert all(torch.equal(pa[n], pb[n]) for n in pa), precision
    assert _same_on_all_ranks(pa)
    kept = sum(st["exp_avg"].numel() for st in opt.state.values())
    total = sum(p.numel() for p in engine.module.parameters())
    assert kept <= total // 2 + 8, (kept, total)  # this rank's half of the momentum, not all of it
    compressed = {"compressed_all_to_all", "compressed_all_gather"}
    assert compressed <= set(moved), moved
    extra = {op: n for op, n in moved.items() if op not in compressed}
    if precision:  # the 16-bit weights are all-gathered after the masters' step, and the
        # ranks agree on overflow of their local gradients (one float each step)
        assert set(extra) == {"all_gather_into_tensor", "all_reduce"}, moved
        assert extra["all_gather_into_tensor"] <= (total + 64) * 2 * 8 and extra["all_reduce"] == 4 * 8, moved
    else:  # fp32: every rank applies the same update, nothing else crosses the wire
        assert not extra, moved
    return sorted(precision) or ["fp32"]


def _zero1_resume(tmp: str):
    cfg = _config("OneBitAdam", {"freeze_step": 8}, zero_optimization={"stage": 1})
    engine, _ = _engine(cfg)
    _train(engine, 12)
    path = os.path.join(tmp, "zero1")
    engine.save_checkpoint(path, tag="s12")
    want = _train(engine, 6, start=12)
    want_params = _params(engine)
    fresh, opt = _engine(cfg)
    fresh.load_checkpoint(path, tag="s12")
    assert opt.rank_state_dict()
    got = _train(fresh, 6, start=12)
    assert got == want, (got, want)
    got_params = _params(fresh)
    assert all(torch.equal(got_params[n], want_params[n]) for n in got_params)


def _zero1_body(rank: int, world: int, tmp: str):
    import shardwise

    torch.use_deterministic_algorithms(True)
    done = run_subtests(_zero1_case, [{}, {"bf16": {"enabled": True}}, {"fp16": {"enabled": True}}])
    _zero1_resume(tmp)
    errors = {}
    for opt_type, params in (("ZeroOneAdam", {}), ("OneBitLamb", {})):
        model = make_model()
        try:
            shardwise.initialize(model=model, model_parameters=model.parameters(),
                                 config=_config(opt_type, params, zero_optimization={"stage": 1}))
        except ValueError as e:
            errors[opt_type] = str(e)
    return done, errors


def test_onebit_adam_at_zero1_equals_stage0_bitwise(tmp_path):
    results = run_distributed(_zero1_body, 2, args=(str(tmp_path),), timeout=240)
    done, errors = results[0]
    assert done == [["fp32"], ["bf16"], ["fp16"]]
    assert "zero_optimization.stage=1" in errors["ZeroOneAdam"] and "local steps" in errors["ZeroOneAdam"]
    assert "zero_optimization.stage=1" in errors["OneBitLamb"] and "trust ratios" in errors["OneBitLamb"]


@pytest.fixture(scope="module")
def two_rank_results(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("onebit"))
    return run_distributed(_two_rank_body, 2, args=(tmp,), timeout=240), tmp


def test_warmup_equals_adam_and_lamb_bitwise(two_rank_results):
    results, _ = two_rank_results
    assert results[0]["warm"] == ["OneBitAdam", "ZeroOneAdam", "OneBitLamb"]


def test_after_warmup_within_1_5x_of_adam_with_5x_less_traffic(two_rank_results):
    results, _ = two_rank_results
    after = {name: (losses, moved, same) for name, losses, moved, same in results[0]["after"]}
    adam_losses, adam_moved, _ = after["Adam"]
    adam_bytes = adam_moved["all_reduce"]
    assert adam_losses[-1] < 0.5 * adam_losses[0]  # the toy problem is learnable
    for name, reference in (("OneBitAdam", "Adam"), ("ZeroOneAdam", "Adam"), ("OneBitLamb", "Lamb")):
        losses, moved, same = after[name]
        ref_losses = after[reference][0]
        final, ref = sum(losses[-3:]) / 3, sum(ref_losses[-3:]) / 3
        assert final <= 1.5 * ref, (name, final, reference, ref)
        assert final < 0.85 * losses[0], (name, losses)  # and it did learn
        compressed = moved["compressed_all_to_all"] + moved["compressed_all_gather"] + moved.get("all_reduce", 0)
        assert adam_bytes >= 5 * compressed, (name, adam_bytes, compressed)
        if name != "ZeroOneAdam":  # 0/1 Adam's replicas differ between synchronisations, by design
            assert same, name


def test_fp16_overflow_on_one_rank_skips_everywhere(two_rank_results):
    results, _ = two_rank_results
    assert all(r["overflow"] == "agreed" for r in results)


def test_bitwise_resume_after_warmup(two_rank_results):
    results, _ = two_rank_results
    assert results[0]["resumed"] == ["OneBitAdam", "ZeroOneAdam", "OneBitLamb"]


def test_refusals_say_why(two_rank_results):
    _, tmp = two_rank_results
    errors = run_distributed(_one_rank_body, 1, args=(tmp,), timeout=120)[0]
    for name in ("OneBitAdam", "ZeroOneAdam", "OneBitLamb"):
        assert "cannot be resharded" in errors[name] and "Load it with 2 ranks" in errors[name], errors.get(name)
    assert "stage1" not in errors  # OneBitAdam runs at stage 1 (test_onebit_adam_at_zero1_equals_stage0_bitwise)
    assert "zero_optimization.stage=2" in errors["stage2"] and "Use zero_optimization.stage 0 or 1" in errors["stage2"]
    assert "partitioned" in errors["stage3"]
    assert "comm_backend_name" in errors["nccl"] and "'gloo'" in errors["nccl"]


# ----------------------------------------------------------------------------- config parameters (no processes)

def _build(type_name, params):
    from shardwise.optim import build_optimizer

    return build_optimizer(type_name, params, make_model().parameters())


def test_deepspeed_parameters_accepted_and_checked():
    common = {"lr": 1e-3, "betas": [0.9, 0.99], "eps": 1e-8, "weight_decay": 0.0, "cuda_aware": False,
              "comm_backend_name": "compressed", "bias_correction": True, "amsgrad": False}
    opt = _build("OneBitAdam", {**common, "freeze_step": 5})
    assert opt.freeze_step == 5 and opt.param_groups[0]["betas"] == (0.9, 0.99)
    opt = _build("zerooneadam", {**common, "var_freeze_step": 9, "var_update_scaler": 2, "local_step_scaler": 3,
                                 "local_step_clipper": 4})
    assert (opt.var_freeze_step, opt.var_update_scaler, opt.local_step_scaler, opt.local_step_clipper) == (9, 2, 3, 4)
    opt = _build("OneBitLamb", {**common, "freeze_step": 5, "max_coeff": 5.0, "min_coeff": 0.1, "coeff_beta": 0.8,
                                "factor_max": 3.0, "factor_min": 0.6, "factor_threshold": 0.2})
    assert (opt.coeff_beta, opt.factor_max, opt.factor_min, opt.factor_threshold) == (0.8, 3.0, 0.6, 0.2)

    for type_name, params, words in [
        ("OneBitAdam", {"freeze_step": 0}, "optimizer.params.freeze_step"),
        ("OneBitAdam", {"freeze_stepp": 3}, "Did you mean 'freeze_step'"),
        ("OneBitAdam", {"amsgrad": True}, "optimizer.params.amsgrad"),
        ("ZeroOneAdam", {"local_step_clipper": 0}, "optimizer.params.local_step_clipper"),
        ("OneBitLamb", {"factor_min": 5.0}, "optimizer.params.factor_min"),
        ("OneBitLamb", {"cuda_aware": "yes"}, "optimizer.params.cuda_aware"),
    ]:
        with pytest.raises(ValueError) as info:
            _build(type_name, params)
        assert words in str(info.value), (type_name, params, str(info.value))


def test_onebit_lamb_after_warmup_keeps_the_trust_ratio_of_steady_gradients():
    """With the same gradient every step nothing changes at the freeze, so the factor must stay 1 and
    the trust ratio must be the warm-up's average, bias-corrected like Adam's moments (comparing the
    fresh variance uncorrected makes the factor fall 10% a step; averaging from 0 gives a ratio of
    (1 - 0.9**10) = 65% of the warm-up's). benchmarks/onebit_convergence.py."""
    import shardwise

    class Linear(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.linspace(-1.0, 1.0, 48).view(6, 8))

        def forward(self, c):
            return (self.w * c).sum()

    freeze, beta = 10, 0.9
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_clipping": 0.0,
           "optimizer": {"type": "OneBitLamb", "params": {"lr": 1e-3, "freeze_step": freeze, "coeff_beta": beta}}}
    engine, opt, _, _ = shardwise.initialize(model=Linear(), config=cfg)
    c = torch.linspace(0.5, 2.0, 48).view(6, 8)
    average, coeffs = 0.0, []
    for step in range(freeze + 5):
        engine.backward(engine(c))
        engine.step()
        (coeff,) = opt.get_lamb_coeffs()
        if step < freeze:
            average = beta * average + (1 - beta) * coeff
        else:
            coeffs.append(coeff)
    want = average / (1 - beta**freeze)
    assert coeffs == pytest.approx([want] * 5, rel=1e-4), (coeffs, want)
