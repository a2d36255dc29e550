"""Loss scaling, overflow detection, precision policy and input casting."""

from __future__ import annotations

import json
from collections import OrderedDict, namedtuple
from types import SimpleNamespace

import pytest
import torch

from shardwise.precision import (
    DynamicLossScaler,
    PrecisionPolicy,
    StaticLossScaler,
    cast_inputs,
    create_loss_scaler,
    apply_coefficient_,
    grad_sq_sum,
    unscale_and_clip,
)

O, C = True, False  # overflow / clean step

# Worked out by hand with init 16, window 3, hysteresis 2, min 1.
# A clean step doubles the scale when (iteration - last_overflow_iteration - 1) is a
# positive multiple of the window; last_overflow_iteration starts at -1.
EVENTS = [C, C, C, C, O, O, O, C, C, C, C, O, C, O, O]
EXPECTED = [
    16,  # it 0 clean: stable 0
    16,  # it 1: stable 1
    16,  # it 2: stable 2
    32,  # it 3: stable 3 -> double
    32,  # it 4 overflow: hysteresis 2 -> 1, scale kept
    16,  # it 5 overflow: hysteresis exhausted -> halve
    8,  # it 6 overflow: halve again (hysteresis stays used up)
    8,  # it 7 clean: stable 0
    8,  # it 8: stable 1
    8,  # it 9: stable 2
    16,  # it 10: stable 3 -> double, hysteresis refilled to 2
    16,  # it 11 overflow: hysteresis 2 -> 1
    16,  # it 12 clean: stable 0; hysteresis NOT refilled (not consecutive mode)
    8,  # it 13 overflow: hysteresis is 1 -> halve
    4,  # it 14 overflow: halve
]
# consecutive_hysteresis: every clean step refills the hysteresis, so it 13 only consumes it.
EXPECTED_CONSECUTIVE = EXPECTED[:13] + [16, 8]


def _run(scaler, events):
    out = []
    for overflow in events:
        scaler.update_scale(overflow)
        out.append(scaler.loss_scale)
    return out


def test_dynamic_scale_sequence():
    scaler = DynamicLossScaler(init_scale=16, scale_window=3, delayed_shift=2, min_scale=1)
    assert scaler.loss_scale == 16
    assert _run(scaler, EVENTS) == EXPECTED


def test_consecutive_hysteresis():
    scaler = DynamicLossScaler(init_scale=16, scale_window=3, delayed_shift=2, min_scale=1, consecutive_hysteresis=True)
    assert _run(scaler, EVENTS) == EXPECTED_CONSECUTIVE


def test_no_hysteresis_halves_on_every_overflow_and_window_restarts():
    scaler = DynamicLossScaler(init_scale=64, scale_window=2, delayed_shift=1, min_scale=1)
    # it0 O ->32; it1 C stable 0; it2 C stable 1; it3 C stable 2 -> 64; it4 C stable 3; it5 C stable 4 -> 128
    assert _run(scaler, [O, C, C, C, C, C]) == [32, 32, 32, 64, 64, 128]


def test_scale_never_below_min_and_error_at_min():
    scaler = DynamicLossScaler(init_scale=3, scale_window=100, delayed_shift=1, min_scale=2)
    assert _run(scaler, [O]) == [2]  # max(3 / 2, 2)
    with pytest.raises(RuntimeError) as info:
        scaler.update_scale(True)
    msg = str(info.value)
    assert "minimum loss scale" in msg and "learning rate" in msg and "fp16.min_loss_scale" in msg


def test_hysteresis_still_applies_at_min_scale_and_error_can_be_disabled():
    scaler = DynamicLossScaler(init_scale=1, scale_window=100, delayed_shift=2, min_scale=1)
    scaler.update_scale(True)  # consumes hysteresis, no error yet
    with pytest.raises(RuntimeError):
        scaler.update_scale(True)
    quiet = DynamicLossScaler(init_scale=2, delayed_shift=1, min_scale=1, raise_error_at_min_scale=False)
    assert _run(quiet, [O, O, O]) == [1, 1, 1]


def test_static_scaler_never_changes():
    scaler = StaticLossScaler(128.0)
    assert _run(scaler, [O, C, O, O, C]) == [128.0] * 5
    assert scaler.scale_loss(torch.tensor(2.0)).item() == 256.0
    with pytest.raises(ValueError):
        StaticLossScaler(0)


def test_dynamic_state_dict_round_trip_continues_identically():
    kw = dict(init_scale=16, scale_window=3, delayed_shift=2, min_scale=1)
    first = DynamicLossScaler(**kw)
    _run(first, EVENTS[:9])
    sd = json.loads(json.dumps(first.state_dict()))
    resumed = DynamicLossScaler(**kw)
    resumed.load_state_dict(sd)
    assert resumed.loss_scale == EXPECTED[8]
    assert _run(resumed, EVENTS[9:]) == EXPECTED[9:]


def test_state_dict_kind_mismatch_is_an_error():
    with pytest.raises(ValueError, match="dynamic"):
        DynamicLossScaler().load_state_dict(StaticLossScaler(8).state_dict())
    with pytest.raises(ValueError, match="static"):
        StaticLossScaler(8).load_state_dict(DynamicLossScaler().state_dict())


def _fp16(**over):
    cfg = dict(
        loss_scale=0,
        initial_scale_power=16,
        loss_scale_window=1000,
        hysteresis=2,
        consecutive_hysteresis=False,
        min_loss_scale=1,
    )
    cfg.update(over)
    return SimpleNamespace(**cfg)


def test_create_loss_scaler_from_config():
    dyn = create_loss_scaler(_fp16(initial_scale_power=5, loss_scale_window=7, hysteresis=3, min_loss_scale=0.5,
                                   consecutive_hysteresis=True))
    assert isinstance(dyn, DynamicLossScaler)
    assert (dyn.loss_scale, dyn.scale_window, dyn.delayed_shift, dyn.min_scale) == (32.0, 7, 3, 0.5)
    assert dyn.consecutive_hysteresis and dyn.scale_factor == 2.0
    static = create_loss_scaler(_fp16(loss_scale=256))
    assert isinstance(static, StaticLossScaler) and static.loss_scale == 256.0
    assert create_loss_scaler(None).loss_scale == 1.0


@pytest.mark.parametrize(
    "over, key",
    [
        ({"loss_scale": -1}, "fp16.loss_scale"),
        ({"hysteresis": 0}, "fp16.hysteresis"),
        ({"loss_scale_window": 0}, "fp16.loss_scale_window"),
        ({"min_loss_scale": 0}, "fp16.min_loss_scale"),
        ({"initial_scale_power": -2}, "fp16.initial_scale_power"),
    ],
)
def test_create_loss_scaler_rejects_bad_values(over, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        create_loss_scaler(_fp16(**over))


# ------------------------------------------------------------------ overflow check


def _overflows(tensors) -> bool:
    _, coef = unscale_and_clip(grad_sq_sum(tensors), loss_scale=1.0, clip=0.0, check_overflow=True)
    return coef is None


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_overflow_check(dtype, bad):
    clean = [torch.randn(7, 3).to(dtype), torch.randn(5).to(dtype)]
    assert _overflows(clean) is False
    poisoned = [t.clone() for t in clean]
    poisoned[1][3] = bad
    assert _overflows(poisoned) is True
    assert _overflows(iter(poisoned)) is True  # any iterable


def test_overflow_check_large_finite_fp16_is_not_overflow():
    big = torch.full((1000,), 65504.0, dtype=torch.float16)  # fp16 max; its sum/L2 norm would overflow in fp16
    assert _overflows([big, -big]) is False


def test_overflow_check_mixed_dtypes_and_empty():
    tensors = [torch.empty(0), torch.ones(2, dtype=torch.bfloat16)]
    assert _overflows(tensors) is False
    assert _overflows([]) is False
    tensors.append(torch.tensor([1.0, float("nan")], dtype=torch.float16))
    assert _overflows(tensors) is True


def test_unscale_and_clip_matches_clip_grad_norm():
    grads = [torch.randn(10, 3), torch.randn(7)]
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    expected_norm = float(torch.nn.utils.clip_grad_norm_(params, 0.5))
    scaled = [g * 8.0 for g in grads]  # as with a loss scale of 8
    norm, coef = unscale_and_clip(grad_sq_sum(scaled), loss_scale=8.0, clip=0.5, check_overflow=True)
    assert norm == pytest.approx(expected_norm, rel=1e-6)
    apply_coefficient_(scaled, coef)
    for s, p in zip(scaled, params):
        torch.testing.assert_close(s, p.grad, rtol=1e-6, atol=1e-7)


# ------------------------------------------------------------------ policy


def _cfg(fp16=False, bf16=False, auto_cast=False, check=True):
    return SimpleNamespace(
        fp16=SimpleNamespace(enabled=fp16, auto_cast=auto_cast),
        bf16=SimpleNamespace(enabled=bf16, check_grad_overflow=check),
    )


def test_precision_policy_from_config():
    fp16 = PrecisionPolicy.from_config(_cfg(fp16=True, auto_cast=True))
    assert fp16 == PrecisionPolicy(torch.float16, master_weights=True, loss_scaling=True, auto_cast=True,
                                   check_overflow=True)
    bf16 = PrecisionPolicy.from_config(_cfg(bf16=True, check=False))
    assert bf16 == PrecisionPolicy(torch.bfloat16, master_weights=True, loss_scaling=False, auto_cast=False,
                                   check_overflow=False)
    assert PrecisionPolicy.from_config(_cfg(bf16=True)).check_overflow is True
    fp32 = PrecisionPolicy.from_config(_cfg())
    assert fp32 == PrecisionPolicy(torch.float32, master_weights=False, loss_scaling=False, auto_cast=False,
                                   check_overflow=False)
    with pytest.raises(ValueError, match="fp16.enabled"):
        PrecisionPolicy.from_config(_cfg(fp16=True, bf16=True))
    with pytest.raises(Exception):
        fp16.param_dtype = torch.float32  # frozen


# ------------------------------------------------------------------ input casting


def test_cast_inputs_nested():
    Pair = namedtuple("Pair", "x mask")
    ids = torch.tensor([1, 2, 3])
    x = torch.randn(2, 2)
    obj = {
        "input": [x, (x.double(), "text", None)],
        "ids": ids,
        "pair": Pair(x, torch.ones(2, dtype=torch.bool)),
        "od": OrderedDict(a=x, b=3.5),
    }
    out = cast_inputs(obj, torch.float16)
    assert out["input"][0].dtype == torch.float16 and torch.equal(out["input"][0], x.half())
    assert isinstance(out["input"][1], tuple) and out["input"][1][0].dtype == torch.float16
    assert out["input"][1][1:] == ("text", None)
    assert out["ids"] is ids
    assert isinstance(out["pair"], Pair) and out["pair"].x.dtype == torch.float16
    assert out["pair"].mask.dtype == torch.bool
    assert isinstance(out["od"], OrderedDict) and out["od"]["a"].dtype == torch.float16 and out["od"]["b"] == 3.5
    # the caller's structure is not modified
    assert obj["input"][0].dtype == torch.float32 and obj["od"]["a"].dtype == torch.float32
    assert cast_inputs(x, torch.bfloat16).dtype == torch.bfloat16
    assert cast_inputs(7, torch.float16) == 7


@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf")])
def test_standalone_clip_grad_norm_matches_torch(norm_type):
    """``shardwise.precision.clip_grad_norm_`` (DeepSpeed's stand-alone helper calls it) clips as torch does on
    one process; ``count_replicated=False`` leaves out the parameters that are not tensor-sharded."""
    from shardwise.precision import clip_grad_norm_

    def grads():
        ps = [torch.nn.Parameter(torch.zeros(3)) for _ in range(2)]
        for p, g in zip(ps, ([3.0, -1.0, 2.0], [0.5, 4.0, -2.0])):
            p.grad = torch.tensor(g)
        return ps

    mine, ref = grads(), grads()
    norm = clip_grad_norm_(mine, 1.5, norm_type)
    want = torch.nn.utils.clip_grad_norm_(ref, 1.5, norm_type)
    assert torch.allclose(norm, want) and all(torch.allclose(a.grad, b.grad) for a, b in zip(mine, ref))
    sharded = grads()
    sharded[1].tensor_model_parallel = True
    if norm_type != float("inf"):
        assert torch.allclose(clip_grad_norm_(sharded, 100.0, norm_type, count_replicated=False),
                              torch.tensor([0.5, 4.0, -2.0]).norm(norm_type))
