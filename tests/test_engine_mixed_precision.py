"""fp16 dynamic loss scaling (overflow skips the step) and bf16 training through the engine."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from distributed import run_distributed
from models import base_config, make_data, make_model, mse


def _fp16_overflow_body(rank: int, world: int):
    return {stage: _fp16_overflow(rank, stage) for stage in (0, 1, 2)}


def _fp16_overflow(rank: int, stage: int):
    import shardwise

    cfg = base_config(fp16={"enabled": True, "initial_scale_power": 8, "hysteresis": 1, "loss_scale_window": 1000},
                      zero_optimization={"stage": stage, "reduce_bucket_size": 40})
    model = make_model()
    engine, _, _, _ = shardwise.initialize(model=model, config=cfg)
    x, y = make_data(8, 8)
    log = []
    for s in range(8):
        xs = x[s, rank * 4 : (rank + 1) * 4]
        loss = mse(engine(xs.half()), y[s, rank * 4 : (rank + 1) * 4])
        if s == 3 and rank == 1:  # inject an inf gradient on one rank only
            loss = loss + engine.module.fc2.weight.sum() * float("inf")
        before = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
        scale_before = engine.cur_scale
        engine.backward(loss)
        engine.step()
        changed = any(not torch.equal(before[n], p) for n, p in engine.module.named_parameters())
        log.append(
            {"skipped": engine.was_step_skipped(), "overflow": engine.optimizer.overflow, "scale_before": scale_before, "scale_after": engine.cur_scale,
             "changed": changed, "loss": float(loss.detach()) if s != 3 else None}
        )
    dtypes = {str(p.dtype) for p in engine.module.parameters()}
    masters = {str(t.dtype) for t in engine.strategy.master_named_params().values()}
    return {"log": log, "skipped_steps": engine.skipped_steps, "global_steps": engine.global_steps,
            "dtypes": dtypes, "masters": masters}


def test_fp16_injected_overflow_skips_step_lowers_scale_and_continues_stages_0_1_2():
    results = run_distributed(_fp16_overflow_body, 2, timeout=240)
    for r in (res[stage] for res in results for stage in (0, 1, 2)):
        log = r["log"]
        assert r["dtypes"] == {"torch.float16"} and r["masters"] == {"torch.float32"}
        # Step 3 overflowed on rank 1 only, yet every rank skipped it together.
        assert [e["skipped"] for e in log] == [False, False, False, True, False, False, False, False]
        assert [e["overflow"] for e in log] == [e["skipped"] for e in log]  # DeepSpeed's optimizer.overflow
        assert log[3]["changed"] is False, "weights moved on a skipped step"
        assert log[3]["scale_after"] == log[3]["scale_before"] / 2 == 2.0 ** 7
        assert all(e["changed"] for i, e in enumerate(log) if i != 3)
        assert r["skipped_steps"] == 1 and r["global_steps"] == 8
        losses = [e["loss"] for e in log if e["loss"] is not None]
        assert all(torch.isfinite(torch.tensor(losses)))  # fresh random batches each step: no trend to check


def _bf16_body(rank: int, world: int):
    return [_bf16(rank, world, stage) for stage in (0, 1, 2)]


def _bf16(rank: int, world: int, stage: int):
    import shardwise

    cfg = base_config(bf16={"enabled": True}, communication_data_type="fp32",
                      zero_optimization={"stage": stage, "reduce_bucket_size": 40})
    model = make_model()
    engine, _, _, _ = shardwise.initialize(model=model, config=cfg)
    x, y = make_data(1, 8)
    losses = []
    for _ in range(30):  # fit one fixed batch: the loss must fall
        loss = mse(engine(x[0, rank * 4 : (rank + 1) * 4].to(torch.bfloat16)), y[0, rank * 4 : (rank + 1) * 4])
        engine.backward(loss)
        engine.step()
        t = loss.detach().float()
        dist.all_reduce(t)
        losses.append(t.item() / world)
    return losses, {str(p.dtype) for p in engine.module.parameters()}, engine.skipped_steps


def test_bf16_trains_stages_0_1_2():
    per_stage, _ = run_distributed(_bf16_body, 2, timeout=240)
    for losses, dtypes, skipped in per_stage:
        assert dtypes == {"torch.bfloat16"}
        assert skipped == 0
        assert losses[-1] < 0.7 * losses[0], losses


def _fp16_auto_cast_body(rank: int, world: int):
    import shardwise

    cfg = base_config(fp16={"enabled": True, "auto_cast": True})
    model = make_model()
    engine, _, _, _ = shardwise.initialize(model=model, config=cfg)
    x, _ = make_data(1, 8)
    out = engine(x[0, :4])  # fp32 input: auto_cast turns it into fp16 before the fp16 model sees it
    return str(out.dtype)


def _one_rank_body(rank: int, world: int):
    return {"auto_cast": _fp16_auto_cast_body(rank, world), "buffers": _buffer_dtypes_body(rank, world)}


@pytest.fixture(scope="module")
def one_rank():
    """The single-process checks, in one spawned process (a spawn costs more than the checks)."""
    (r,) = run_distributed(_one_rank_body, 1, timeout=180)
    return r


def test_fp16_auto_cast_casts_inputs(one_rank):
    assert one_rank["auto_cast"] == "torch.float16"


class _Rotary(torch.nn.Module):
    """A linear layer with two fp32 buffers: a rotary-style ``inv_freq`` and a routing bias that the
    model's transformers list keeps in fp32."""

    _keep_in_fp32_modules_strict = ["router_bias"]

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(7, 3)
        self.register_buffer("inv_freq", 1.0 + torch.arange(3) / 1024.0)  # 1/1024 steps: bf16 rounds them away
        self.register_buffer("router_bias", 5.0 + torch.arange(3) / 512.0)

    def forward(self, x):
        return self.fc(x) * self.inv_freq + self.router_bias


def _buffer_dtypes_body(rank: int, world: int):
    import shardwise

    out = {}
    cases = {"default": ({}, 0), "default_zero3": ({}, 3), "bf16_buffers": ({"buffer_dtype": "bf16"}, 0),
             "bf16_buffers_keep_inv": ({"buffer_dtype": "bf16", "keep_in_fp32_modules": ["inv_*"]}, 0),
             "param_dtype_matching": ({"param_dtype": "bfloat16"}, 0)}
    for name, (data_types, stage) in cases.items():
        torch.manual_seed(0)
        model = _Rotary()
        cfg = base_config(bf16={"enabled": True}, data_types=data_types, zero_optimization={"stage": stage})
        engine, _, _, _ = shardwise.initialize(model=model, config=cfg)
        x, y = make_data(2, 4)
        for s in range(2):
            engine.backward(mse(engine(x[s].bfloat16()), y[s]))
            engine.step()
        out[name] = {"params": {str(p.dtype) for p in engine.module.parameters()},
                     "inv_freq": (str(engine.module.inv_freq.dtype), engine.module.inv_freq.unique().numel()),
                     "router_bias": str(engine.module.router_bias.dtype)}
    return out


def test_buffers_keep_their_dtype_unless_data_types_buffer_dtype_says(one_rank):
    """As DeepSpeed 0.19.8: under bf16 the parameters train in bf16, buffers stay as built (fp32) by
    default (ZeRO-3 too); ``data_types.buffer_dtype`` casts them, except those the model's
    ``_keep_in_fp32_modules_strict`` or ``data_types.keep_in_fp32_modules`` names."""
    r = one_rank["buffers"]
    bf, fp = "torch.bfloat16", "torch.float32"
    for name in ("default", "default_zero3", "param_dtype_matching"):
        assert r[name] == {"params": {bf}, "inv_freq": (fp, 3), "router_bias": fp}, name
    assert r["bf16_buffers"] == {"params": {bf}, "inv_freq": (bf, 1), "router_bias": fp}
    assert r["bf16_buffers_keep_inv"] == {"params": {bf}, "inv_freq": (fp, 3), "router_bias": bf}
