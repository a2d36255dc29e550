"""``deepspeed.zero.Init`` of the compat package (compat/deepspeed): shardwise's zero.Init with DeepSpeed's
memory-efficient linear (``torch.nn.functional.linear`` becomes ``zero3_linear_wrap`` for the rest of the
process, the original kept as ``InsertPostInitMethodToModuleSubClasses.linear_bk``), and the methods DeepSpeed
gives each ZeRO-3 parameter (``all_gather``, ``all_gather_coalesced``, ``partition``, the partition sizes).

Everything runs in processes of tests/distributed.py that put the compat package first on their path (the
compat package's import hook stays out of this process): the swap is process-wide by design.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

from distributed import run_distributed

REPO = Path(__file__).resolve().parents[1]
COMPAT = REPO / "compat" / "deepspeed"

ZERO3 = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
         "optimizer": {"type": "Adam", "params": {"lr": 0.05}},
         "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(6, 5)
        self.b = torch.nn.Linear(5, 3)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def _swap_body(rank: int, world: int, compat: str, repo: str):
    sys.path[:0] = [compat, repo]
    import torch.nn.functional as F

    import deepspeed
    import shardwise
    from deepspeed.runtime.zero.linear import LinearFunctionForZeroStage3
    from deepspeed.runtime.zero.partition_parameters import InsertPostInitMethodToModuleSubClasses as holder
    from deepspeed.runtime.zero.partition_parameters import zero3_linear_wrap

    out = {}
    import deepspeed.zero as imported
    out["zero_module"] = (imported is deepspeed.zero is deepspeed.runtime.zero
                          and issubclass(deepspeed.zero.Init, shardwise.zero.Init)
                          and deepspeed.zero.GatheredParameters
                          is deepspeed.runtime.zero.partition_parameters.GatheredParameters)
    torch_linear = F.linear
    out["no_backup_yet"] = not hasattr(holder, "linear_bk")
    off = {**ZERO3, "zero_optimization": {**ZERO3["zero_optimization"], "memory_efficient_linear": False}}
    with deepspeed.zero.Init(config_dict_or_path=off, mem_efficient_linear=True):  # the config decides
        torch.nn.Linear(2, 2)
    out["config_off_keeps_linear"] = F.linear is torch_linear and not hasattr(holder, "linear_bk")
    try:
        deepspeed.zero.Init(config_dict_or_path={"zero_optimization": {"memory_efficient_linear": "yes"}})
        out["bad_value"] = None
    except ValueError as e:
        out["bad_value"] = str(e)
    init = deepspeed.zero.Init(config_dict_or_path=ZERO3)
    out["built_not_entered"] = F.linear is torch_linear
    with init:
        out["entered"] = F.linear is zero3_linear_wrap and holder.linear_bk is torch_linear
        with deepspeed.zero.Init():  # nested, default mem_efficient_linear=True: nothing changes
            out["nested"] = F.linear is zero3_linear_wrap and holder.linear_bk is torch_linear
        torch.manual_seed(0)
        model = _Net()
    out["kept_after_exit"] = F.linear is zero3_linear_wrap
    F.linear = torch_linear  # put back by the user: an Init around a built module swaps it again
    deepspeed.zero.Init(module=torch.nn.Linear(3, 3))
    out["module_swaps_again"] = F.linear is zero3_linear_wrap and holder.linear_bk is torch_linear

    def other(input, weight, bias=None):
        return zero3_linear_wrap(input, weight, bias)
    F.linear = other  # someone else's wrapper is left alone
    with deepspeed.zero.Init():
        pass
    out["other_wrapper_kept"] = F.linear is other
    F.linear = zero3_linear_wrap

    # the function itself, with F.linear swapped: torch's values and gradients, 3-D input, with and without bias
    torch.manual_seed(1)
    x = torch.randn(2, 3, 4, requires_grad=True)
    w = torch.randn(5, 4, requires_grad=True)
    b = torch.randn(5, requires_grad=True)
    for bias in (b, None):
        got = F.linear(x, w, bias)
        grads = torch.autograd.grad(got.square().sum(), [x, w] + ([bias] if bias is not None else []))
        want = torch._C._nn.linear(x, w, bias)
        wgrads = torch.autograd.grad(want.square().sum(), [x, w] + ([bias] if bias is not None else []))
        assert got.grad_fn.name().startswith("LinearFunctionForZeroStage3"), got.grad_fn.name()
        torch.testing.assert_close(got, want)
        for g, wg in zip(grads, wgrads):
            torch.testing.assert_close(g, wg)
    out["function_matches_torch"] = True
    out["vector_weight"] = F.linear(torch.ones(2, 4), torch.ones(4)).tolist()  # not a matrix: torch's kernel

    # training through the swapped F.linear: ZeRO-3 releases each weight after forward; backward reads the
    # parameter itself (what the function saved), gathered again; the losses are one process's
    torch.manual_seed(0)
    ref = _Net()
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        ref.load_state_dict({k: v.clone() for k, v in model.state_dict().items()})
    saved_params = []

    def pack(t):
        if isinstance(t, torch.nn.Parameter):
            saved_params.append(t.ds_numel if hasattr(t, "ds_numel") else -1)
        return t

    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ZERO3)
    opt = torch.optim.Adam(ref.parameters(), lr=0.05)
    losses, want = [], []
    for step in range(3):
        g = torch.Generator().manual_seed(10 + step)
        xs, ys = torch.randn(world, 2, 6, generator=g), torch.randn(world, 2, 3, generator=g)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = F.mse_loss(engine(xs[rank]), ys[rank])
        out["released_after_forward"] = engine.module.a.weight.numel() == 0
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        ref_loss = sum(F.mse_loss(ref(xs[r]), ys[r]) for r in range(world)) / world
        ref_loss.backward()
        opt.step()
        opt.zero_grad()
        want.append(ref_loss.item())
    out["saved_the_parameters"] = sorted(set(saved_params)) == [3, 5, 5 * 3, 6 * 5]  # the weights and biases only
    losses = torch.tensor(losses)
    torch.distributed.all_reduce(losses)
    out["losses"] = (losses / world).tolist()
    out["want"] = want
    return out


def test_zero_init_installs_the_memory_efficient_linear_and_trains_with_it():
    out = run_distributed(_swap_body, 2, args=(str(COMPAT), str(REPO)))[0]
    losses, want = out.pop("losses"), out.pop("want")
    bad_value = out.pop("bad_value")
    vector = out.pop("vector_weight")
    assert all(out.values()), out
    assert bad_value is not None and "zero_optimization.memory_efficient_linear" in bad_value
    assert vector == [4.0, 4.0]
    for got, ref in zip(losses, want):
        assert abs(got - ref) <= 1e-5 * max(1.0, abs(ref)), (losses, want)


class _Holder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.p = torch.nn.Parameter(torch.arange(1.0, 6.0))  # 5 elements: one of padding on 2 ranks
        self.q = torch.nn.Parameter(torch.arange(1.0, 5.0).view(2, 2))


def _param_methods_body(rank: int, world: int, compat: str, repo: str):
    sys.path[:0] = [compat, repo]
    import deepspeed
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    out = {}
    with deepspeed.zero.Init(config_dict_or_path=ZERO3, mem_efficient_linear=False):
        holder = _Holder()
    p, q = holder.p, holder.q
    out["sizes"] = [p.partition_numel(), p.aligned_size(), p.padding_size(), q.padding_size()]
    out["released"] = p.numel() == 0 and p.ds_status == ZeroParamStatus.NOT_AVAILABLE
    p.all_gather_coalesced([p, q]).wait()
    out["gathered"] = [p.data.tolist(), q.data.tolist(), p.ds_status == ZeroParamStatus.AVAILABLE]
    p.partition(param_list=[p, q])
    out["partitioned"] = p.numel() == 0 and q.numel() == 0 and q.ds_status == ZeroParamStatus.NOT_AVAILABLE
    p.all_gather()
    with torch.no_grad():
        p.data.mul_(10)  # every rank makes the same change
    p.partition(has_been_updated=True)
    p.all_gather()
    out["updated"] = p.data.tolist()
    p.partition(has_been_updated=False)
    p.partition()  # nothing gathered by all_gather: no change, no error
    out["partition_twice"] = p.numel() == 0

    # an engine's ZeRO-3 parameters have the methods too; an update written back reaches the next forward
    torch.manual_seed(0)
    lin = torch.nn.Linear(3, 2, bias=False)
    engine, *_ = deepspeed.initialize(model=lin, model_parameters=lin.parameters(), config=ZERO3)
    w = engine.module.weight
    w.all_gather()
    with torch.no_grad():
        w.data.copy_(torch.tensor([[1.0, 2.0, 3.0], [0.0, -1.0, 0.5]]))
    w.partition(has_been_updated=True)
    out["engine_forward"] = engine(torch.ones(1, 3)).tolist()
    return out


def test_zero3_parameters_gather_and_partition_themselves():
    results = run_distributed(_param_methods_body, 2, args=(str(COMPAT), str(REPO)))
    assert results[0] == results[1]
    out = results[0]
    assert out["sizes"] == [3, 6, 1, 0]
    assert out["released"] and out["partitioned"] and out["partition_twice"]
    assert out["gathered"] == [[1.0, 2.0, 3.0, 4.0, 5.0], [[1.0, 2.0], [3.0, 4.0]], True]
    assert out["updated"] == [10.0, 20.0, 30.0, 40.0, 50.0]
    assert out["engine_forward"] == [[6.0, -0.5]]


class _Tagger(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(10, 8)
        self.proj = torch.nn.Linear(8, 4)

    def forward(self, ids):
        return self.proj(self.emb(ids))


def _quantized_body(rank: int, world: int, compat: str, repo: str):
    sys.path[:0] = [compat, repo]
    import torch.nn.functional as F

    import deepspeed
    from deepspeed.inference.quantization.utils import DeQuantizer, Quantizer
    from deepspeed.runtime.zero.partition_parameters import zero3_linear_wrap

    out = {}
    # the codes: per group of 4 along the last dimension, codes / scale + min is within half a step of the value
    torch.manual_seed(2)
    w = torch.randn(6, 8)
    for bits in (8, 4):
        cfg = {"num_bits": bits, "group_size": 4, "group_dim": 1, "symmetric": False}
        codes, scale, low = Quantizer(cfg).quantize(w)
        back = DeQuantizer(cfg, torch.float32).dequantize(codes, scale, low)
        groups = w.view(6, 2, 4)
        step = (groups.amax(-1, keepdim=True) - groups.amin(-1, keepdim=True)) / (2**bits - 1)
        out[f"codes_{bits}"] = [tuple(codes.shape), codes.dtype == torch.uint8, tuple(scale.shape)]
        out[f"within_half_step_{bits}"] = bool(((back.view(6, 2, 4) - groups).abs() <= step / 2 + 1e-6).all())
        out[f"group_extremes_exact_{bits}"] = bool(torch.allclose(back.view(6, 2, 4).amin(-1), groups.amin(-1)))
    constant = torch.full((2, 4), 3.0)  # a constant group: codes 0, dequantized exactly
    c_codes, c_scale, c_low = Quantizer({"num_bits": 8, "group_size": 4, "group_dim": 1, "symmetric": False}
                                        ).quantize(constant)
    out["constant_group"] = DeQuantizer({"num_bits": 8, "group_size": 4, "group_dim": 1, "symmetric": False},
                                        torch.float32).dequantize(c_codes, c_scale, c_low).tolist()

    quant = {"num_bits": 8, "group_size": 4, "group_dim": 1, "symmetric": False}
    config = {**ZERO3, "weight_quantization": {"quantized_initialization": quant}}
    try:
        deepspeed.zero.Init(config_dict_or_path={**config, "weight_quantization": {
            "quantized_initialization": {**quant, "num_bits": 3}}})
        out["bad_bits"] = None
    except ValueError as e:
        out["bad_bits"] = str(e)
    try:  # the dequantizing F.linear comes with the memory-efficient linear
        deepspeed.zero.Init(config_dict_or_path={**config, "zero_optimization": {"memory_efficient_linear": False}})
        out["needs_linear"] = None
    except ValueError as e:
        out["needs_linear"] = str(e)
    torch.manual_seed(0)
    plain = _Tagger()  # the same initial values, not quantized
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=config, dtype=torch.float32):
        model = _Tagger()
    out["wrapped"] = (F.linear.__wrapped__ is zero3_linear_wrap and getattr(F.embedding, "__wrapped__", None)
                      is not None and F.linear is not zero3_linear_wrap)
    weights = [model.emb.weight, model.proj.weight]
    out["quantized"] = [bool(getattr(p, "weight_quantized", False)) for p in weights] + \
        [bool(getattr(model.proj.bias, "weight_quantized", False))]
    # stored: 1 byte a value (as float32: a quarter of the elements) plus a scale and a minimum per group
    out["stored_numel"] = [p.ds_numel for p in weights]
    ids = torch.tensor([[1, 4, 9], [0, 0, 7]])
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        got = model(ids)
        full = {"emb": model.emb.weight.dequantizer.dequantize(
                    model.emb.weight.deconcat(model.emb.weight)[0].view(torch.uint8),
                    *model.emb.weight.deconcat(model.emb.weight)[1:]),
                "proj": model.proj.weight.dequantizer.dequantize(
                    model.proj.weight.deconcat(model.proj.weight)[0].view(torch.uint8),
                    *model.proj.weight.deconcat(model.proj.weight)[1:])}
        # a full-precision state dict loads into the quantized layers: quantized again, the same codes
        before = [p.data.clone() for p in weights]
        model.load_state_dict(plain.state_dict())
        out["reload_same_codes"] = all(torch.equal(b.view(torch.uint8), p.data.view(torch.uint8))
                                       for b, p in zip(before, weights))  # (code bytes as floats: may be NaNs)
    want = F.linear(full["emb"][ids], full["proj"], plain.proj.bias)
    out["forward_is_dequantized"] = torch.allclose(got, want, atol=1e-6)
    out["close_to_plain"] = float((got - plain(ids)).abs().max())
    # an engine runs the quantized model (its config leaves weight_quantization out)
    engine, *_ = deepspeed.initialize(model=model, config={"train_micro_batch_size_per_gpu": 1,
                                                           "zero_optimization": {"stage": 3}})
    engine.eval()
    with torch.no_grad():
        out["engine_forward_is_dequantized"] = torch.allclose(engine(ids), want, atol=1e-6)
    # a bf16 config: the weights are quantized in bf16, which a bf16 engine does not cast again
    bf16 = {"bf16": {"enabled": True}}
    with deepspeed.zero.Init(config_dict_or_path={**config, **bf16}):
        model16 = _Tagger()
    out["bf16_storage"] = model16.proj.weight.dtype == torch.bfloat16
    with deepspeed.zero.GatheredParameters(list(model16.parameters())), torch.no_grad():
        want16 = model16(ids)
    engine16, *_ = deepspeed.initialize(model=model16, config={"train_micro_batch_size_per_gpu": 1, **bf16,
                                                               "zero_optimization": {"stage": 3}})
    engine16.eval()
    with torch.no_grad():
        out["bf16_engine_forward"] = torch.equal(engine16(ids), want16)
    return out


def test_zero_init_quantizes_weights_at_build_and_dequantizes_them_on_use():
    results = run_distributed(_quantized_body, 2, args=(str(COMPAT), str(REPO)))
    assert results[0] == results[1]
    out = results[0]
    bad_bits, close, needs_linear = out.pop("bad_bits"), out.pop("close_to_plain"), out.pop("needs_linear")
    assert needs_linear is not None and "zero_optimization.memory_efficient_linear" in needs_linear
    assert bad_bits is not None and "weight_quantization.quantized_initialization.num_bits" in bad_bits
    assert out.pop("codes_8") == [(6, 8), True, (6, 2, 1)] and out.pop("codes_4") == [(6, 4), True, (6, 2, 1)]
    assert out.pop("constant_group") == [[3.0] * 4] * 2
    assert out.pop("quantized") == [True, True, False]
    # Embedding(10, 8): 80 codes = 20 float32, 20 groups -> 20 scales + 20 minimums; Linear(8, 4): 8 + 8 + 8
    assert out.pop("stored_numel") == [60, 24]
    assert all(out.values()), out
    assert 0 < close < 0.05
