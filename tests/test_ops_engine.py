"""``shardwise.ops`` optimizers as client optimizers: ZeRO 0-3, CPU and NVMe offload, 2 ranks,
parity with single-process training (fp32, the parity tests' tolerance).

Lamb runs at stage 0 only: its trust ratio is per tensor, and stages 1-3 step fragments of
tensors (as DeepSpeed, which needs zero_allow_untested_optimizer for it)."""

from __future__ import annotations

import torch

from distributed import run_distributed, run_subtests
from models import base_config, make_data, make_model, mse, reference_training_for, zero_fill_grads

STEPS, BATCH = 4, 8


def _make_opt(name, params):
    from shardwise.ops.adagrad import DeepSpeedCPUAdagrad
    from shardwise.ops.adam import DeepSpeedCPUAdam, FusedAdam
    from shardwise.ops.lamb import FusedLamb
    from shardwise.ops.lion import DeepSpeedCPULion

    return {
        "cpu_adam": lambda: DeepSpeedCPUAdam(params, lr=1e-2, weight_decay=0.01),
        "fused_adam": lambda: FusedAdam(params, lr=1e-2, weight_decay=0.01),
        "cpu_adagrad": lambda: DeepSpeedCPUAdagrad(params, lr=1e-2),
        "cpu_lion": lambda: DeepSpeedCPULion(params, lr=1e-3, weight_decay=0.01),
        "fused_lamb": lambda: FusedLamb(params, lr=1e-2, weight_decay=0.01),
    }[name]()


CASES = [
    ("cpu_adam", 0, "none"), ("cpu_adam", 1, "cpu"), ("cpu_adam", 2, "none"), ("cpu_adam", 2, "cpu"),
    ("cpu_adam", 3, "none"), ("cpu_adam", 3, "cpu"), ("cpu_adam", 3, "nvme"),
    ("fused_adam", 2, "nvme"), ("cpu_adagrad", 2, "cpu"), ("cpu_lion", 3, "cpu"), ("fused_lamb", 0, "none"),
]


def _case(case, rank, world, nvme_dir):
    import shardwise

    name, stage, device = case
    z = {"stage": stage, "reduce_bucket_size": 40, "sub_group_size": 60}
    if device != "none":
        z["offload_optimizer"] = {"device": device, "nvme_path": nvme_dir, "buffer_count": 2}
    if stage == 3:
        z["stage3_param_persistence_threshold"] = 0
    cfg = base_config(train_micro_batch_size_per_gpu=BATCH // world, zero_optimization=z)
    del cfg["optimizer"]
    model = make_model()
    engine, opt, *_ = shardwise.initialize(model=model, optimizer=_make_opt(name, model.parameters()), config=cfg)
    assert type(opt).__module__.startswith("shardwise.ops."), type(opt)
    x, y = make_data(STEPS, BATCH)
    per = BATCH // world
    losses = []
    for s in range(STEPS):
        loss = mse(engine(x[s, rank * per:(rank + 1) * per]), y[s, rank * per:(rank + 1) * per])
        engine.backward(loss)
        engine.step()
        t = loss.detach().clone()
        torch.distributed.all_reduce(t)
        losses.append(t.item() / world)
    from shardwise.utils import safe_get_full_fp32_param

    return losses, {n: safe_get_full_fp32_param(p) for n, p in model.named_parameters()}


def _body(rank, world, nvme_dir):
    return run_subtests(_case, CASES, rank, world, nvme_dir)


def _reference(name):
    if name == "cpu_adam":  # torch's own AdamW, the reference the others were checked against
        return reference_training_for(make_model(), STEPS, BATCH)
    model = make_model()
    opt = _make_opt(name, [p for p in model.parameters() if p.requires_grad])
    x, y = make_data(STEPS, BATCH)
    losses = []
    for s in range(STEPS):
        loss = mse(model(x[s]), y[s])
        opt.zero_grad()
        loss.backward()
        zero_fill_grads(model)
        opt.step()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def test_ops_optimizers_as_client_optimizers_at_every_stage_and_offload(tmp_path):
    results = run_distributed(_body, 2, args=(str(tmp_path / "nvme"),), timeout=300)
    refs = {name: _reference(name) for name in {c[0] for c in CASES}}
    for case, res0, res1 in zip(CASES, results[0], results[1]):
        ref_losses, ref_params = refs[case[0]]
        for losses, params in (res0, res1):
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-6, atol=1e-7,
                                       msg=f"{case}")
            for n in ref_params:
                torch.testing.assert_close(params[n], ref_params[n], rtol=1e-5, atol=1e-6, msg=f"{case}: {n}")
