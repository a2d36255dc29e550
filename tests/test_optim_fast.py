"""Fast optimizer paths (torch's fused kernels, our chunked updates) against the reference steps.

Every path is compared with a reference implementation over several steps on tensors larger
than one chunk (``shardwise.optim.chunked.CHUNK``) and of a size that is not a multiple of it:

- config ``Adam``/``AdamW``/``SGD``/``Adagrad`` (torch's fused kernels) against torch's
  single-tensor reference (``foreach=False``): largest relative difference observed 4e-6
  (Adam/AdamW, 6 steps), 0 (SGD), 2e-5 (Adagrad: its ``sqrt(sum)`` of tiny sums amplifies one
  rounding); bound asserted ``rtol=5e-5, atol=1e-6``;
- ``Lion`` chunked against its foreach reference: bitwise equal (the same ops per element);
- ``Lamb`` chunked against its foreach reference: the trust ratio's norms are summed per chunk
  (in fp64), largest difference observed 1.5e-6 absolute on unit-scale weights, bound
  ``rtol=1e-5, atol=1e-5``; its trust ratios are within 1e-6 relative of a float64 run, the
  foreach path's within 1.6e-5;
- the chunked Adam/Adagrad/Lion used where torch has no kernel (``bias_correction=False``,
  fp32 states for 16-bit parameters) against torch's reference ops run in fp32 and rounded
  into the parameter each step: bitwise equal in fp32, at most one bf16 rounding step apart.
"""

from __future__ import annotations

import inspect

import pytest
import torch

from shardwise.optim import Lamb, Lion, build_optimizer
from shardwise.optim.chunked import CHUNK

SHAPES = [(3 * CHUNK + 1001,), (37, 29), (5,)]  # multi-chunk with a ragged tail, 2-d, tiny


def _params(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).to(dtype).requires_grad_() for s in SHAPES]


def _clone(ps):
    return [p.detach().clone().requires_grad_() for p in ps]


def _grads(step, dtype=torch.float32):
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(s, generator=g).to(dtype) for s in SHAPES]


def _step(opt, ps, step, dtype=torch.float32, **kw):
    for p, g in zip(ps, _grads(step, dtype)):
        p.grad = g
    opt.step(**kw)


def _max_rel(a, b):
    return max(((x.double() - y.double()).abs() / (y.double().abs() + 1e-6)).max().item() for x, y in zip(a, b))


# ------------------------------------------------------------------ config optimizers: torch's fused kernels


@pytest.mark.parametrize(
    "type_name, hp, ref_cls, ref_hp",
    [
        ("Adam", {"lr": 0.01, "weight_decay": 0.1, "adam_w_mode": False}, torch.optim.Adam, {"weight_decay": 0.1}),
        ("AdamW", {"lr": 0.01, "weight_decay": 0.1}, torch.optim.AdamW, {"weight_decay": 0.1}),
        ("SGD", {"lr": 0.1, "momentum": 0.9, "nesterov": True}, torch.optim.SGD, {"momentum": 0.9, "nesterov": True}),
        ("Adagrad", {"lr": 0.1, "lr_decay": 0.01, "weight_decay": 0.01}, torch.optim.Adagrad,
         {"lr_decay": 0.01, "weight_decay": 0.01}),
    ],
)
def test_config_optimizers_take_torch_fused_kernel_and_match_reference(type_name, hp, ref_cls, ref_hp):
    ours = _params()
    ref = _clone(ours)
    opt = build_optimizer(type_name, hp, ours)
    assert opt.defaults["fused"] is True and type(opt) is ref_cls
    ref_opt = ref_cls(ref, lr=hp["lr"], foreach=False, fused=False, **ref_hp)
    start = [p.detach().clone() for p in ours]
    for s in range(6):
        _step(opt, ours, s)
        _step(ref_opt, ref, s)
    for a, b, s0 in zip(ours, ref, start):
        torch.testing.assert_close(a, b, rtol=5e-5, atol=1e-6)
        assert not torch.equal(a, s0)


def test_explicit_foreach_or_fused_false_wins():
    opt = build_optimizer("AdamW", {"foreach": True}, _params())
    assert opt.defaults["fused"] is None and opt.defaults["foreach"] is True
    opt = build_optimizer("AdamW", {"fused": False}, _params())
    assert not opt.defaults["fused"]


def test_adam_without_bias_correction_matches_reference_ops():
    ours = _params()
    start = [p.detach().double() for p in ours]
    lr, (b1, b2), eps, wd = 0.01, (0.9, 0.99), 1e-8, 0.1
    opt = build_optimizer("Adam", {"lr": lr, "betas": [b1, b2], "weight_decay": wd, "bias_correction": False}, ours)
    ms = [torch.zeros_like(p) for p in start]
    vs = [torch.zeros_like(p) for p in start]
    for s in range(4):
        _step(opt, ours, s)
        for i, g in enumerate(_grads(s)):
            g = g.double()
            start[i] = start[i] * (1 - lr * wd)
            ms[i] = b1 * ms[i] + (1 - b1) * g
            vs[i] = b2 * vs[i] + (1 - b2) * g * g
            start[i] = start[i] - lr * ms[i] / (vs[i].sqrt() + eps)
    for a, e in zip(ours, start):
        torch.testing.assert_close(a.double(), e, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ Lion / Lamb: chunked vs foreach reference


def test_lion_chunked_equals_foreach_reference():
    ours = _params()
    ref = _clone(ours)
    opt = build_optimizer("Lion", {"lr": 0.01, "betas": [0.9, 0.99], "weight_decay": 0.1}, ours)
    ref_opt = Lion(ref, lr=0.01, betas=(0.9, 0.99), weight_decay=0.1, foreach=True)
    for s in range(4):
        _step(opt, ours, s)
        _step(ref_opt, ref, s)
    for a, b in zip(ours, ref):
        assert torch.equal(a, b)
    for p, q in zip(ours, ref):
        assert torch.equal(opt.state[p]["exp_avg"], ref_opt.state[q]["exp_avg"])


@pytest.mark.parametrize("hp", [{"weight_decay": 0.01}, {"eps_inside_sqrt": True, "bias_correction": False}])
def test_lamb_chunked_matches_foreach_reference(hp):
    ours = _params()
    ref = _clone(ours)
    opt = build_optimizer("Lamb", {"lr": 0.05, **hp}, ours)
    ref_opt = Lamb(ref, lr=0.05, foreach=True, **hp)
    exact = [p.detach().double().requires_grad_() for p in ours]
    exact_opt = Lamb(exact, lr=0.05, foreach=True, **hp)
    for s in range(4):
        _step(opt, ours, s)
        _step(ref_opt, ref, s)
        _step(exact_opt, exact, s, torch.float64)
        # The chunked norms (fp64 sums of chunk partials) are closer to a float64 run than the
        # foreach path's fp32 norms: 1e-6 relative against up to 1.6e-5 seen for foreach.
        assert opt.get_lamb_coeffs() == pytest.approx(exact_opt.get_lamb_coeffs(), rel=5e-6)
        assert opt.get_lamb_coeffs() == pytest.approx(ref_opt.get_lamb_coeffs(), rel=5e-5)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------ shardwise.ops against the references


def _ops():
    from shardwise.ops.adagrad import DeepSpeedCPUAdagrad
    from shardwise.ops.adam import DeepSpeedCPUAdam, FusedAdam
    from shardwise.ops.lamb import FusedLamb
    from shardwise.ops.lion import DeepSpeedCPULion, FusedLion

    return DeepSpeedCPUAdam, FusedAdam, FusedLamb, DeepSpeedCPUAdagrad, DeepSpeedCPULion, FusedLion


@pytest.mark.parametrize("case", ["cpu_adamw", "cpu_adam_l2", "fused_adam", "cpu_adagrad", "cpu_lion", "fused_lion",
                                  "fused_lamb"])
def test_ops_fp32_match_reference(case):
    CPUAdam, FusedAdam, FusedLamb, CPUAdagrad, CPULion, FusedLionCls = _ops()
    make = {
        "cpu_adamw": (lambda ps: CPUAdam(ps, lr=0.01, weight_decay=0.1),
                      lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1, foreach=False)),
        "cpu_adam_l2": (lambda ps: CPUAdam(ps, lr=0.01, weight_decay=0.1, adamw_mode=False),
                        lambda ps: torch.optim.Adam(ps, lr=0.01, weight_decay=0.1, foreach=False)),
        "fused_adam": (lambda ps: FusedAdam(ps, lr=0.01, betas=(0.8, 0.9), weight_decay=0.1),
                       lambda ps: torch.optim.AdamW(ps, lr=0.01, betas=(0.8, 0.9), weight_decay=0.1, foreach=False)),
        "cpu_adagrad": (lambda ps: CPUAdagrad(ps, lr=0.1, weight_decay=0.01),
                        lambda ps: torch.optim.Adagrad(ps, lr=0.1, eps=1e-10, weight_decay=0.01, foreach=False)),
        "cpu_lion": (lambda ps: CPULion(ps, lr=0.01, weight_decay=0.1),
                     lambda ps: Lion(ps, lr=0.01, weight_decay=0.1, foreach=True)),
        "fused_lion": (lambda ps: FusedLionCls(ps, lr=0.01, weight_decay=0.1),
                       lambda ps: Lion(ps, lr=0.01, weight_decay=0.1, foreach=True)),
        "fused_lamb": (lambda ps: FusedLamb(ps, lr=0.05, weight_decay=0.01),
                       lambda ps: Lamb(ps, lr=0.05, weight_decay=0.01, foreach=True)),
    }[case]
    ours = _params()
    ref = _clone(ours)
    opt, ref_opt = make[0](ours), make[1](ref)
    for s in range(5):
        _step(opt, ours, s)
        _step(ref_opt, ref, s)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=5e-5, atol=1e-5)


def _rounded_reference(make_ref, dtype, steps):
    """torch's reference step on fp32 copies, the result rounded into a 16-bit parameter every step."""
    p16 = _params(dtype)
    work = [p.detach().float().requires_grad_() for p in p16]
    opt = make_ref(work)
    for s in range(steps):
        for w, p, g in zip(work, p16, _grads(s, dtype)):
            w.grad = g.float()
        opt.step()
        for w, p in zip(work, p16):
            p.data.copy_(w.detach())  # round into the 16-bit parameter ...
            w.data.copy_(p.detach())  # ... which is what the next step starts from
    return p16


@pytest.mark.parametrize("case", ["cpu_adam", "cpu_adam_nobc", "cpu_adagrad", "cpu_lion"])
def test_ops_fp32_states_for_bf16_params_match_rounded_reference(case):
    CPUAdam, _, _, CPUAdagrad, CPULion, _ = _ops()
    ours = _params(torch.bfloat16)
    if case == "cpu_adam":
        opt = CPUAdam(ours, lr=0.01, weight_decay=0.1)
        make_ref = lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1, foreach=False)  # noqa: E731
    elif case == "cpu_adam_nobc":  # no torch reference without bias correction: our fp32 chunked step is one
        opt = CPUAdam(ours, lr=0.01, weight_decay=0.1, bias_correction=False)
        make_ref = lambda ps: CPUAdam(ps, lr=0.01, weight_decay=0.1, bias_correction=False)  # noqa: E731
    elif case == "cpu_adagrad":
        opt = CPUAdagrad(ours, lr=0.1)
        make_ref = lambda ps: torch.optim.Adagrad(ps, lr=0.1, eps=1e-10, foreach=False)  # noqa: E731
    else:
        opt = CPULion(ours, lr=0.01, weight_decay=0.1)
        make_ref = lambda ps: Lion(ps, lr=0.01, weight_decay=0.1, foreach=True)  # noqa: E731
    for s in range(3):
        _step(opt, ours, s, torch.bfloat16)
    state = next(iter(opt.state.values()))
    assert all(v.dtype == torch.float32 for k, v in state.items() if k != "step")
    ref = _rounded_reference(make_ref, torch.bfloat16, 3)
    for a, b in zip(ours, ref):
        assert a.dtype == torch.bfloat16
        # equal up to one bf16 rounding step (the fp32 math differs from the reference in the last bit)
        torch.testing.assert_close(a.float(), b.float(), rtol=2 ** -7, atol=1e-6)
        assert (a != b).float().mean() < 0.01


def test_ops_refuse_amsgrad_and_non_cpu_parameters_as_deepspeed():
    CPUAdam, FusedAdam, FusedLamb, CPUAdagrad, CPULion, _ = _ops()
    for cls in (CPUAdam, FusedAdam, FusedLamb):
        with pytest.raises(RuntimeError, match="AMSGrad"):
            cls(_params(), amsgrad=True)
    CPUAdagrad(_params(), amsgrad=True)  # accepted and ignored, as in DeepSpeed
    for cls in (CPUAdam, CPUAdagrad, CPULion):
        p = torch.zeros(4, device="meta", requires_grad=True)
        p.grad = torch.zeros(4, device="meta")
        with pytest.raises(ValueError, match=f"{cls.__name__}: a parameter is on meta"):
            cls([p]).step()


def test_fused_lamb_scale_and_grad_norm_clipping():
    _, _, FusedLamb, *_ = _ops()
    a, b = _params(), _params()
    opt_a = FusedLamb(a, lr=0.05, max_grad_norm=1.0)
    opt_b = Lamb(b, lr=0.05, foreach=True)
    for s in range(3):
        grads = _grads(s)
        norm = torch.linalg.vector_norm(torch.cat([g.reshape(-1) for g in grads])).item()
        for p, q, g in zip(a, b, grads):
            p.grad = g * 4.0  # as if scaled by a loss scale of 4
            q.grad = g / ((norm + 1e-6) / 1.0)  # what the clip leaves
        opt_a.step(scale=4.0, grad_norms=[norm * 4.0])
        opt_b.step()
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)


def test_set_grad_none_and_state_dict_roundtrip():
    CPUAdam, FusedAdam, *_ = _ops()
    ps = _params()
    opt = FusedAdam(ps, set_grad_none=False)
    _step(opt, ps, 0)
    opt.zero_grad()
    assert all(p.grad is not None and not p.grad.any() for p in ps)
    straight = _params()
    o = CPUAdam(straight, lr=0.01)
    for s in range(4):
        _step(o, straight, s)
    first = _params()
    o1 = CPUAdam(first, lr=0.01)
    for s in range(2):
        _step(o1, first, s)
    second = _clone(first)
    o2 = CPUAdam(second, lr=0.01)
    o2.load_state_dict(o1.state_dict())
    for s in range(2, 4):
        _step(o2, second, s)
    for x, y in zip(straight, second):
        assert torch.equal(x, y)


# DeepSpeed 0.19.8's parameter names (deepspeed/ops/*/*.py), in order.
DEEPSPEED_SIGNATURES = {
    "adam.DeepSpeedCPUAdam": ["model_params", "lr", "bias_correction", "betas", "eps", "weight_decay", "amsgrad",
                              "adamw_mode", "fp32_optimizer_states"],
    "adam.FusedAdam": ["params", "lr", "bias_correction", "betas", "eps", "adam_w_mode", "weight_decay", "amsgrad",
                       "set_grad_none"],
    "lamb.FusedLamb": ["params", "lr", "bias_correction", "betas", "eps", "eps_inside_sqrt", "weight_decay",
                       "max_grad_norm", "max_coeff", "min_coeff", "amsgrad"],
    "adagrad.DeepSpeedCPUAdagrad": ["model_params", "lr", "eps", "weight_decay", "amsgrad", "fp32_optimizer_states"],
    "lion.DeepSpeedCPULion": ["model_params", "lr", "betas", "weight_decay", "fp32_optimizer_states"],
    "lion.FusedLion": ["params", "lr", "betas", "weight_decay", "set_grad_none"],
}
DEEPSPEED_DEFAULTS = {
    "adam.DeepSpeedCPUAdam": {"lr": 1e-3, "bias_correction": True, "betas": (0.9, 0.999), "eps": 1e-8,
                              "weight_decay": 0, "amsgrad": False, "adamw_mode": True, "fp32_optimizer_states": True},
    "adagrad.DeepSpeedCPUAdagrad": {"lr": 1e-2, "eps": 1e-10},
    "lamb.FusedLamb": {"max_grad_norm": 0.0, "max_coeff": 10.0, "min_coeff": 0.01},
}


@pytest.mark.parametrize("path", sorted(DEEPSPEED_SIGNATURES))
def test_ops_signatures_are_deepspeeds(path):
    import importlib

    module, name = path.split(".")
    cls = getattr(importlib.import_module(f"shardwise.ops.{module}"), name)
    sig = inspect.signature(cls.__init__)
    assert [n for n in sig.parameters if n != "self"] == DEEPSPEED_SIGNATURES[path]
    for arg, default in DEEPSPEED_DEFAULTS.get(path, {}).items():
        assert sig.parameters[arg].default == default, arg
    submodule = {"DeepSpeedCPUAdam": "cpu_adam", "FusedAdam": "fused_adam", "FusedLamb": "fused_lamb",
                 "DeepSpeedCPUAdagrad": "cpu_adagrad", "DeepSpeedCPULion": "cpu_lion", "FusedLion": "fused_lion"}
    assert getattr(importlib.import_module(f"shardwise.ops.{module}.{submodule[name]}"), name) is cls


def test_fp32_states_survive_state_dict_round_trip_with_bf16_params():
    CPUAdam, _, _, CPUAdagrad, CPULion, _ = _ops()
    for cls in (CPUAdam, CPUAdagrad, CPULion):
        straight = _params(torch.bfloat16)
        o = cls(straight, lr=0.01)
        for s in range(3):
            _step(o, straight, s, torch.bfloat16)
        first = _params(torch.bfloat16)
        o1 = cls(first, lr=0.01)
        _step(o1, first, 0, torch.bfloat16)
        second = _clone(first)
        o2 = cls(second, lr=0.01)
        o2.load_state_dict(o1.state_dict())
        state = o2.state[second[0]]
        assert all(v.dtype == torch.float32 for k, v in state.items() if k != "step"), cls.__name__
        for s in range(1, 3):
            _step(o2, second, s, torch.bfloat16)
        for x, y in zip(straight, second):
            assert torch.equal(x, y), cls.__name__


@pytest.mark.parametrize("adamw_mode", [True, False])
def test_cpu_adam_step_subgroup_is_a_step_and_rollback_undoes_it(adamw_mode):
    """DeepSpeed's sub-group interface of DeepSpeedCPUAdam: ``step_subgroup`` computes what ``step``
    does, with one set of moments per sub-group id; ``rollback_subgroup`` brings parameters and moments
    back to before the last step (fp32 rounding), and refuses a sub-group never stepped or at step 0."""
    CPUAdam = _ops()[0]
    torch.manual_seed(0)
    start = torch.randn(64)
    a, b = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
    sub = CPUAdam([a], lr=0.05, weight_decay=0.1, adamw_mode=adamw_mode)
    plain = CPUAdam([b], lr=0.05, weight_decay=0.1, adamw_mode=adamw_mode)
    history = []
    for _ in range(3):
        g = torch.randn(64)
        a.grad, b.grad = g.clone(), g.clone()
        history.append((a.detach().clone(), sub.state[0]["exp_avg"].clone() if 0 in sub.state else None))
        sub.step_subgroup(0)
        plain.step()
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-6, atol=1e-7)
    assert sub.state[0]["step"] == 3 and 1 not in sub.state
    before, m_before = history[-1]
    sub.rollback_subgroup(0)  # the last gradient is still in a.grad
    assert sub.state[0]["step"] == 2
    torch.testing.assert_close(a.detach(), before, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(sub.state[0]["exp_avg"], m_before, rtol=1e-5, atol=1e-6)
    sub.step_subgroup(1)  # another sub-group: its own moments and count
    assert sub.state[1]["step"] == 1 and sub.state[0]["step"] == 2
    with pytest.raises(RuntimeError, match="Cannot rollback optimizer state for sub_group_id 5"):
        sub.rollback_subgroup(5)
    sub.rollback_subgroup(1)
    with pytest.raises(RuntimeError, match="Cannot rollback sub_group_id 1: step count is 0"):
        sub.rollback_subgroup(1)
