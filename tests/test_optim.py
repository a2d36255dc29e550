"""Optimizers built from the ``optimizer`` config block."""

from __future__ import annotations

import math

import pytest
import torch

from shardwise.optim import Lamb, Lion, build_optimizer


def _params(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(4, 3, generator=g).requires_grad_(),
        torch.randn(5, generator=g).requires_grad_(),
    ]


def _grads(step: int, shapes: list[torch.Size]) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(s, generator=g) for s in shapes]


def _run(opt: torch.optim.Optimizer, params: list[torch.Tensor], steps: int = 4) -> None:
    for step in range(steps):
        for p, grad in zip(params, _grads(step, [p.shape for p in params])):
            p.grad = grad.clone()
        opt.step()


def _same_run(config_type: str, config_params: dict, reference_factory, steps: int = 4) -> tuple:
    ours, ref = _params(), _params()
    opt = build_optimizer(config_type, config_params, ours)
    ref_opt = reference_factory(ref)
    _run(opt, ours, steps)
    _run(ref_opt, ref, steps)
    return opt, ours, ref


# ------------------------------------------------------------------ Adam family vs torch


def test_adam_default_is_decoupled_adamw_with_deepspeed_defaults():
    opt, ours, ref = _same_run(
        "Adam",
        {"lr": 0.01},
        lambda ps: torch.optim.AdamW(ps, lr=0.01, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, foreach=True),
    )
    assert type(opt) is torch.optim.AdamW
    assert opt.param_groups[0]["weight_decay"] == 0.0  # DeepSpeed's default, not torch's 0.01
    for a, b in zip(ours, ref):
        assert torch.equal(a, b)


def test_adam_w_mode_true_matches_adamw_bitwise_with_weight_decay():
    hp = {"lr": 0.02, "betas": [0.8, 0.95], "eps": 1e-6, "weight_decay": 0.1}
    _, ours, ref = _same_run(
        "adam",
        {**hp, "adam_w_mode": True, "torch_adam": True},
        lambda ps: torch.optim.AdamW(ps, lr=0.02, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1, foreach=True),
    )
    for a, b in zip(ours, ref):
        assert torch.equal(a, b)


def test_adam_w_mode_false_is_l2_adam():
    opt, ours, ref = _same_run(
        "Adam",
        {"lr": 0.02, "weight_decay": 0.1, "adam_w_mode": False},
        lambda ps: torch.optim.Adam(ps, lr=0.02, weight_decay=0.1, foreach=True),
    )
    assert type(opt) is torch.optim.Adam
    for a, b in zip(ours, ref):
        assert torch.equal(a, b)
    # ... and L2 Adam really differs from decoupled decay on the same data.
    _, decoupled, _ = _same_run("Adam", {"lr": 0.02, "weight_decay": 0.1}, lambda ps: torch.optim.SGD(ps, lr=0.0))
    assert not torch.equal(ours[0], decoupled[0])


def test_adamw_type_uses_deepspeed_weight_decay_default():
    opt, ours, ref = _same_run(
        "ADAMW", {"lr": 0.01}, lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.0, foreach=True)
    )
    assert type(opt) is torch.optim.AdamW
    assert opt.param_groups[0]["weight_decay"] == 0.0
    for a, b in zip(ours, ref):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    "type_name, hp, torch_cls",
    [
        ("SGD", {"lr": 0.1, "momentum": 0.9, "nesterov": True}, torch.optim.SGD),
        ("sgd", {"lr": 0.1, "weight_decay": 0.01}, torch.optim.SGD),
        ("Adagrad", {"lr": 0.1, "lr_decay": 0.01}, torch.optim.Adagrad),
        ("rmsprop", {"lr": 0.01, "alpha": 0.9}, torch.optim.RMSprop),
        ("NAdam", {"lr": 0.01}, torch.optim.NAdam),
    ],
)
def test_torch_optimizers_pass_through(type_name, hp, torch_cls):
    # The config builds torch's fused kernel (where the class has one): same numerics as the
    # single-tensor reference up to rounding (see test_optim_fast.py for the bounds).
    opt, ours, ref = _same_run(type_name, hp, lambda ps: torch_cls(ps, **hp, foreach=False))
    assert type(opt) is torch_cls
    start = _params()
    for a, b, s in zip(ours, ref, start):
        torch.testing.assert_close(a, b, rtol=5e-5, atol=1e-6)
        assert not torch.equal(a, s)  # the parameters really moved


@pytest.mark.parametrize("type_name", ["Adam", "AdamW", "SGD", "Adagrad", "Lamb", "Lion", "RMSprop"])
def test_every_type_updates_parameters(type_name):
    params = _params()
    before = [p.detach().clone() for p in params]
    opt = build_optimizer(type_name, {"lr": 0.01}, params)
    _run(opt, params, steps=2)
    for p, b in zip(params, before):
        assert not torch.equal(p, b)
        assert torch.isfinite(p).all()


def test_param_groups_keep_their_own_hyperparameters():
    a, b = _params(), _params()
    groups = [{"params": [a[0]], "lr": 0.5, "weight_decay": 0.2}, {"params": [a[1]]}]
    opt = build_optimizer("Adam", {"lr": 0.01, "weight_decay": 0.05}, groups)
    assert [g["lr"] for g in opt.param_groups] == [0.5, 0.01]
    assert [g["weight_decay"] for g in opt.param_groups] == [0.2, 0.05]
    ref = torch.optim.AdamW(
        [{"params": [b[0]], "lr": 0.5, "weight_decay": 0.2}, {"params": [b[1]]}],
        lr=0.01,
        weight_decay=0.05,
        foreach=False,
    )
    _run(opt, a)
    _run(ref, b)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=5e-5, atol=1e-6)


def test_generator_of_parameters_and_auto_values():
    model = torch.nn.Linear(3, 2)
    opt = build_optimizer("Adam", {"lr": "auto", "weight_decay": 0.1}, model.parameters())
    assert opt.param_groups[0]["lr"] == 1e-3  # 'auto' falls back to the default
    assert len(opt.param_groups[0]["params"]) == 2


# ------------------------------------------------------------------ Lamb / Lion vs reference steps


def _reference_lamb(params, steps, *, lr, betas, eps, wd, max_coeff, min_coeff, bias_correction=True, inside=False):
    """LAMB as DeepSpeed's FusedLamb kernel computes it, one tensor at a time in float64."""
    b1, b2 = betas
    ps = [p.detach().double().clone() for p in params]
    ms = [torch.zeros_like(p) for p in ps]
    vs = [torch.zeros_like(p) for p in ps]
    coeffs = []
    for t in range(1, steps + 1):
        coeffs = []
        for i, g in enumerate(_grads(t - 1, [p.shape for p in ps])):
            g = g.double()
            ms[i] = b1 * ms[i] + (1 - b1) * g
            vs[i] = b2 * vs[i] + (1 - b2) * g * g
            denom = torch.sqrt(vs[i] + eps) if inside else torch.sqrt(vs[i]) + eps
            update = ms[i] / denom + wd * ps[i]
            w_norm, u_norm = ps[i].norm().item(), update.norm().item()
            coeff = min(max(w_norm / u_norm, min_coeff), max_coeff) if w_norm > 0 and u_norm > 0 else 1.0
            coeffs.append(coeff)
            step_size = lr * math.sqrt(1 - b2**t) / (1 - b1**t) if bias_correction else lr
            ps[i] = ps[i] - step_size * coeff * update
    return ps, coeffs


@pytest.mark.parametrize(
    "hp",
    [
        {},
        {"lr": 0.05, "weight_decay": 0.01, "betas": [0.8, 0.99]},
        {"lr": 0.05, "max_coeff": 0.5, "min_coeff": 0.1},  # clamp from above
        {"lr": 0.05, "min_coeff": 5.0, "max_coeff": 8.0},  # clamp from below
        {"lr": 0.01, "bias_correction": False, "eps_inside_sqrt": True, "eps": 1e-4},
    ],
)
def test_lamb_matches_reference(hp):
    params = _params()
    params[1].data.zero_()  # a zero weight norm takes the trust ratio 1 path
    start = [p.detach().clone() for p in params]
    opt = build_optimizer("Lamb", hp, params)
    assert isinstance(opt, Lamb)
    _run(opt, params, steps=3)
    full = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "max_coeff": 10.0, "min_coeff": 0.01}
    full.update(hp)
    expected, coeffs = _reference_lamb(
        start,
        3,
        lr=full["lr"],
        betas=tuple(full["betas"]),
        eps=full["eps"],
        wd=full["weight_decay"],
        max_coeff=full["max_coeff"],
        min_coeff=full["min_coeff"],
        bias_correction=full.get("bias_correction", True),
        inside=full.get("eps_inside_sqrt", False),
    )
    for p, e in zip(params, expected):
        torch.testing.assert_close(p.detach().double(), e, rtol=1e-5, atol=1e-6)
    assert opt.get_lamb_coeffs() == pytest.approx(coeffs, rel=1e-5)


def test_lion_matches_reference():
    lr, (b1, b2), wd = 0.01, (0.9, 0.99), 0.1
    params = _params()
    ref = [p.detach().clone() for p in params]
    opt = build_optimizer("lion", {"lr": lr, "betas": [b1, b2], "weight_decay": wd}, params)
    assert isinstance(opt, Lion)
    _run(opt, params, steps=3)
    moms = [torch.zeros_like(p) for p in ref]
    for step in range(3):
        for i, g in enumerate(_grads(step, [p.shape for p in ref])):
            direction = torch.sign(b1 * moms[i] + (1 - b1) * g)
            ref[i] = ref[i] * (1 - lr * wd) - lr * direction
            moms[i] = b2 * moms[i] + (1 - b2) * g
    for p, e in zip(params, ref):
        torch.testing.assert_close(p.detach(), e, rtol=1e-6, atol=1e-7)


def test_lion_defaults_are_deepspeeds():
    opt = build_optimizer("Lion", {}, _params())
    group = opt.param_groups[0]
    assert (group["lr"], group["betas"], group["weight_decay"]) == (1e-3, (0.9, 0.999), 0.0)


# ------------------------------------------------------------------ errors


def _error(type_name, params, model_parameters=None):
    with pytest.raises(ValueError) as info:
        build_optimizer(type_name, params, _params() if model_parameters is None else model_parameters)
    return str(info.value)


def test_unknown_type_lists_valid_names_and_suggests():
    msg = _error("Adamm", {})
    assert "optimizer.type" in msg and "Adamm" in msg
    assert "Lamb" in msg and "SGD" in msg
    assert "Did you mean 'Adam'" in msg


@pytest.mark.parametrize("type_name", ["MuAdam", "musgd"])
def test_unimplemented_deepspeed_optimizers_are_refused(type_name):
    msg = _error(type_name, {})
    assert "not implemented yet: optimizer.type=" in msg
    assert type_name.lower() in msg.lower()


def test_unknown_param_names_its_key_and_suggests():
    msg = _error("Adam", {"learning_rate": 0.1})
    assert "optimizer.params.learning_rate" in msg
    msg = _error("Lamb", {"max_coef": 2.0})
    assert "optimizer.params.max_coef" in msg and "max_coeff" in msg


@pytest.mark.parametrize(
    "type_name, params, key",
    [
        ("Adam", {"lr": -1.0}, "optimizer.params.lr"),
        ("Adam", {"lr": "fast"}, "optimizer.params.lr"),
        ("Adam", {"betas": [0.9]}, "optimizer.params.betas"),
        ("Lion", {"betas": [0.9, 1.5]}, "optimizer.params.betas"),
        ("Adam", {"adam_w_mode": "yes"}, "optimizer.params.adam_w_mode"),
        ("SGD", {"nesterov": 1}, "optimizer.params.nesterov"),
        ("RMSprop", {"alpha": -0.5}, "optimizer.params.alpha"),
        ("AdamW", {"adam_w_mode": False}, "optimizer.params.adam_w_mode"),
        ("Adam", {"bias_correction": False, "amsgrad": True}, "optimizer.params.amsgrad"),
        ("Lamb", {"max_grad_norm": 1.0}, "optimizer.params.max_grad_norm"),
    ],
)
def test_bad_param_values_name_the_key(type_name, params, key):
    assert key in _error(type_name, params)


def test_bad_model_parameters():
    assert "model_parameters" in _error("Adam", {}, model_parameters=[])
    with pytest.raises(ValueError, match="model_parameters"):
        build_optimizer("Adam", {}, torch.zeros(3, requires_grad=True))


@pytest.mark.parametrize("type_name", ["Lamb", "Lion"])
def test_own_optimizers_resume_from_state_dict(type_name):
    hp = {"lr": 0.01, "weight_decay": 0.01}
    straight = _params()
    opt = build_optimizer(type_name, hp, straight)
    _run(opt, straight, steps=4)

    first = _params()
    opt_a = build_optimizer(type_name, hp, first)
    _run(opt_a, first, steps=2)
    second = [p.detach().clone().requires_grad_() for p in first]
    opt_b = build_optimizer(type_name, hp, second)
    opt_b.load_state_dict(opt_a.state_dict())
    for step in range(2, 4):  # the same gradients the uninterrupted run saw
        for p, grad in zip(second, _grads(step, [p.shape for p in second])):
            p.grad = grad
        opt_b.step()
    for a, b in zip(straight, second):
        assert torch.equal(a, b)
