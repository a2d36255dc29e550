"""LR schedules: values against the formulas documented by DeepSpeed, state, errors."""

from __future__ import annotations

import json
import math

import pytest
import torch

from shardwise.optim import (
    LRRangeTest,
    OneCycle,
    WarmupCosineLR,
    WarmupDecayLR,
    WarmupLR,
    build_scheduler,
)


def _adam(lr: float = 0.01, groups: int = 1) -> torch.optim.Optimizer:
    params = [{"params": [torch.zeros(2, requires_grad=True)], "lr": lr * (i + 1)} for i in range(groups)]
    return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.999))


def _lr_after(sched, opt, steps: int) -> list[float]:
    """lr of group 0 after each of ``steps`` calls to step(); entry k is the lr at iteration k."""
    out = []
    for _ in range(steps):
        sched.step()
        assert sched.get_last_lr()[0] == pytest.approx(opt.param_groups[0]["lr"], rel=1e-12)
        out.append(opt.param_groups[0]["lr"])
    return out


# ------------------------------------------------------------------ formulas


def test_warmup_lr_log():
    lo, hi, n = 0.001, 0.01, 10
    opt = _adam()
    sched = build_scheduler("WarmupLR", {"warmup_min_lr": lo, "warmup_max_lr": hi, "warmup_num_steps": n}, opt)
    assert opt.param_groups[0]["lr"] == pytest.approx(lo)  # construction sets the lr at iteration -1
    lrs = _lr_after(sched, opt, 15)
    for step in (0, 1, 4, 9, 10, 14):
        expected = lo + (hi - lo) * math.log(step + 1) / math.log(n) if step < n else hi
        assert lrs[step] == pytest.approx(expected, rel=1e-12)


def test_warmup_lr_linear_and_inherited_peak_per_group():
    opt = _adam(lr=0.02, groups=2)  # group lrs 0.02 and 0.04 become the peaks
    sched = WarmupLR(opt, warmup_num_steps=8, warmup_type="linear")
    for step in range(12):
        sched.step()
        for group, peak in zip(opt.param_groups, (0.02, 0.04)):
            expected = peak * step / 8 if step < 8 else peak
            assert group["lr"] == pytest.approx(expected, rel=1e-12)


def test_warmup_decay_lr():
    lo, hi, n, total = 0.0, 0.005, 5, 20
    opt = _adam()
    sched = build_scheduler(
        "warmupdecaylr",
        {"total_num_steps": total, "warmup_min_lr": lo, "warmup_max_lr": hi, "warmup_num_steps": n},
        opt,
    )
    lrs = _lr_after(sched, opt, 25)
    for step in (0, 2, 4, 5, 6, 12, 19, 20, 24):
        if step < n:
            expected = lo + (hi - lo) * math.log(step + 1) / math.log(n)
        else:
            expected = lo + (hi - lo) * max(0.0, (total - step) / (total - n))
        assert lrs[step] == pytest.approx(expected, rel=1e-12, abs=1e-15)


def test_warmup_decay_lr_default_peak_is_1e_3():
    opt = _adam(lr=0.5)
    sched = WarmupDecayLR(opt, total_num_steps=100, warmup_num_steps=2)
    sched.step(1)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.001 * math.log(2) / math.log(2))


@pytest.mark.parametrize("warmup_type", ["log", "linear"])
def test_warmup_cosine_lr(warmup_type):
    base, n, total, min_ratio, cos_min = 0.1, 4, 14, 0.1, 0.01
    opt = _adam(lr=base)
    sched = WarmupCosineLR(
        opt,
        total_num_steps=total,
        warmup_min_ratio=min_ratio,
        warmup_num_steps=n,
        cos_min_ratio=cos_min,
        warmup_type=warmup_type,
    )
    assert opt.param_groups[0]["lr"] == 0.0  # ratio 0 before the first step
    lrs = _lr_after(sched, opt, 20)
    for step in (0, 1, 3, 4, 8, 12, 13, 19):
        if step < n:
            warm = math.log(step + 1) / math.log(n) if warmup_type == "log" else step / n
            ratio = min_ratio + (1 - min_ratio) * warm
        else:
            progress = min(1.0, (step - n + 1) / (total - n))
            ratio = cos_min + (1 - cos_min) * 0.5 * (1 + math.cos(math.pi * progress))
        assert lrs[step] == pytest.approx(base * ratio, rel=1e-12)


def test_lr_range_test_continuous_and_staircase():
    lo, size, rate = 0.001, 4, 2.0
    for staircase in (False, True):
        opt = _adam()
        sched = LRRangeTest(
            opt,
            lr_range_test_min_lr=lo,
            lr_range_test_step_size=size,
            lr_range_test_step_rate=rate,
            lr_range_test_staircase=staircase,
        )
        assert opt.param_groups[0]["lr"] == pytest.approx(lo)
        lrs = _lr_after(sched, opt, 12)
        for step in (0, 2, 3, 7, 11):
            interval = (step + 1) / size
            if staircase:
                interval = math.floor(interval)
            assert lrs[step] == pytest.approx(lo * (1 + rate * interval), rel=1e-12)


def _one_cycle_expected(step, *, lo, hi, first, second, decay_rate=0.0, decay_size=0, stairs=0):
    """lr at iteration ``step``: up over ``first`` steps, down over ``second``, then decay."""
    k = step + 1  # the schedule position after ``step`` has been taken
    if k <= first:
        frac = k / first
        if stairs:
            frac = math.floor(k * stairs / first) / stairs
    elif k < first + second:
        frac = (first + second - k) / second
        if stairs:
            frac = math.floor((first + second - k) * stairs / second) / stairs
    else:
        n = step - (first + second) + 1
        return lo / (1 + decay_rate * n / decay_size) if decay_size and decay_rate else lo
    return lo + (hi - lo) * frac


def test_one_cycle_lr_and_momentum():
    lo, hi, first, second = 0.01, 0.1, 4, 6
    mlo, mhi, decay_rate, decay_size, mom_rate = 0.85, 0.95, 0.5, 2, 0.01
    opt = _adam()
    sched = build_scheduler(
        "OneCycle",
        {
            "cycle_min_lr": lo,
            "cycle_max_lr": hi,
            "cycle_first_step_size": first,
            "cycle_second_step_size": second,
            "decay_lr_rate": decay_rate,
            "decay_step_size": decay_size,
            "cycle_min_mom": mlo,
            "cycle_max_mom": mhi,
            "decay_mom_rate": mom_rate,
        },
        opt,
    )
    assert opt.param_groups[0]["lr"] == pytest.approx(lo)
    assert opt.param_groups[0]["betas"] == pytest.approx((mhi, 0.999))  # momentum mirrors lr; beta2 kept
    for step in range(16):
        sched.step()
        lr = _one_cycle_expected(step, lo=lo, hi=hi, first=first, second=second, decay_rate=decay_rate,
                                 decay_size=decay_size)
        assert opt.param_groups[0]["lr"] == pytest.approx(lr, rel=1e-9), step
        if step + 1 < first + second:
            mom = mhi - (mhi - mlo) * (lr - lo) / (hi - lo)
        else:
            mom = mhi * (1 + mom_rate * (step - first - second + 1) / decay_size)
        beta1, beta2 = opt.param_groups[0]["betas"]
        assert beta1 == pytest.approx(mom, rel=1e-9), step
        assert beta2 == 0.999
        assert sched.get_mom() == [(beta1, 0.999)]  # DeepSpeed's layout: per group, (momentum, beta2)


def test_one_cycle_stairs_and_no_decay():
    lo, hi, first = 0.0, 1.0, 6
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.5)  # no betas: momentum not cycled
    sched = OneCycle(opt, cycle_min_lr=lo, cycle_max_lr=hi, cycle_first_step_size=first, cycle_first_stair_count=3)
    assert sched.get_mom() is None
    lrs = _lr_after(sched, opt, 16)
    for step in range(16):
        expected = _one_cycle_expected(step, lo=lo, hi=hi, first=first, second=first, stairs=3)
        assert lrs[step] == pytest.approx(expected, abs=1e-12), step
    assert lrs[first - 1] == pytest.approx(hi)  # the peak is reached exactly
    assert "betas" not in opt.param_groups[0]


# ------------------------------------------------------------------ interface and state


SCHEDULES = [
    ("WarmupLR", {"warmup_num_steps": 6}),
    ("WarmupDecayLR", {"total_num_steps": 12, "warmup_num_steps": 4, "warmup_type": "linear"}),
    ("WarmupCosineLR", {"total_num_steps": 12, "warmup_num_steps": 3}),
    ("OneCycle", {"cycle_min_lr": 0.001, "cycle_max_lr": 0.01, "cycle_first_step_size": 3, "decay_lr_rate": 0.1,
                  "decay_step_size": 2}),
    ("LRRangeTest", {"lr_range_test_step_size": 3}),
]


@pytest.mark.parametrize("type_name, params", SCHEDULES)
def test_state_dict_round_trip_continues_the_curve(type_name, params):
    opt = _adam()
    sched = build_scheduler(type_name, params, opt)
    for _ in range(5):
        sched.step()
    sd = json.loads(json.dumps(sched.state_dict()))  # plain JSON values
    expected = _lr_after(sched, opt, 10)
    expected_betas = opt.param_groups[0]["betas"]

    fresh_opt = _adam()
    fresh = build_scheduler(type_name, params, fresh_opt)
    fresh.load_state_dict(sd)
    assert fresh.last_batch_iteration == 4
    assert _lr_after(fresh, fresh_opt, 10) == pytest.approx(expected, rel=1e-12)
    assert fresh_opt.param_groups[0]["betas"] == pytest.approx(expected_betas)


@pytest.mark.parametrize("type_name, params", SCHEDULES)
def test_step_with_explicit_iteration_jumps(type_name, params):
    opt_a, opt_b = _adam(), _adam()
    a = build_scheduler(type_name, params, opt_a)
    b = build_scheduler(type_name, params, opt_b)
    for _ in range(8):
        a.step()
    b.step(7)
    assert b.last_batch_iteration == 7
    assert b.get_last_lr() == pytest.approx(a.get_last_lr())
    assert b.get_lr() == pytest.approx(a.get_lr())


def test_resume_constructor_leaves_optimizer_alone():
    opt = _adam(lr=0.123)
    sched = WarmupLR(opt, warmup_num_steps=10, last_batch_iteration=5)
    assert opt.param_groups[0]["lr"] == 0.123
    with pytest.raises(RuntimeError, match="step"):
        sched.get_last_lr()
    sched.step()
    assert sched.last_batch_iteration == 6
    assert opt.param_groups[0]["lr"] == pytest.approx(0.123 * math.log(7) / math.log(10))


def test_tensor_lr_is_updated_in_place():
    lr = torch.tensor(0.01)
    opt = torch.optim.Adam([torch.zeros(2, requires_grad=True)], lr=lr)
    sched = WarmupLR(opt, warmup_min_lr=0.0, warmup_max_lr=0.02, warmup_num_steps=4, warmup_type="linear")
    sched.step()
    sched.step()
    assert opt.param_groups[0]["lr"] is lr
    assert float(lr) == pytest.approx(0.02 * 1 / 4)


def test_per_group_lists():
    opt = _adam(groups=2)
    sched = WarmupLR(opt, warmup_min_lr=[0.0, 0.1], warmup_max_lr=[1.0, 0.2], warmup_num_steps=4,
                     warmup_type="linear")
    sched.step(2)
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.5, 0.15])
    with pytest.raises(ValueError, match="warmup_max_lr"):
        WarmupLR(opt, warmup_max_lr=[1.0, 2.0, 3.0])


def test_torch_scheduler_names_pass_through():
    opt = _adam(lr=1.0)
    sched = build_scheduler("steplr", {"step_size": 2, "gamma": 0.5}, opt)
    assert isinstance(sched, torch.optim.lr_scheduler.StepLR)
    lrs = []
    for _ in range(5):
        opt.step()
        sched.step()
        lrs.append(opt.param_groups[0]["lr"])
    assert lrs == pytest.approx([1.0, 0.5, 0.5, 0.25, 0.25])


# ------------------------------------------------------------------ errors


def _error(type_name, params):
    with pytest.raises(ValueError) as info:
        build_scheduler(type_name, params, _adam())
    return str(info.value)


def test_unknown_type():
    msg = _error("WarmupCosine", {})
    assert "scheduler.type" in msg and "WarmupCosineLR" in msg


@pytest.mark.parametrize(
    "type_name, params, key",
    [
        ("WarmupDecayLR", {}, "scheduler.params.total_num_steps"),
        ("WarmupCosineLR", {"warmup_num_steps": 3}, "scheduler.params.total_num_steps"),
        ("OneCycle", {"cycle_max_lr": 0.1}, "scheduler.params.cycle_min_lr"),
        ("WarmupLR", {"warmup_num_steps": 0}, "scheduler.params.warmup_num_steps"),
        ("WarmupLR", {"warmup_num_steps": 2.5}, "scheduler.params.warmup_num_steps"),
        ("WarmupLR", {"warmup_type": "cosine"}, "scheduler.params.warmup_type"),
        ("WarmupLR", {"warmup_max_lr": "high"}, "scheduler.params.warmup_max_lr"),
        ("WarmupDecayLR", {"total_num_steps": -5}, "scheduler.params.total_num_steps"),
        ("LRRangeTest", {"lr_range_test_step_size": 0}, "scheduler.params.lr_range_test_step_size"),
        ("OneCycle", {"cycle_min_lr": 0.1, "cycle_max_lr": 1, "cycle_first_step_size": 0},
         "scheduler.params.cycle_first_step_size"),
        ("StepLR", {"step_size": 2, "gama": 0.5}, "scheduler.params.gama"),
    ],
)
def test_bad_params_name_the_key(type_name, params, key):
    assert key in _error(type_name, params)


def test_unknown_param_suggests_the_right_one():
    msg = _error("WarmupLR", {"warmup_steps": 10})
    assert "scheduler.params.warmup_steps" in msg and "warmup_num_steps" in msg
