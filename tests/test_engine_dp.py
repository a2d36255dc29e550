"""ZeRO stage 0 (data parallelism): parity with single-process training and torch DDP."""

from __future__ import annotations

import torch
import torch.distributed as dist

from distributed import run_distributed
from models import base_config, make_data, make_model, mse, reference_training, zero_fill_grads

STEPS = 5
GLOBAL_BATCH = 8


def _train_shardwise(rank: int, world: int, cfg: dict, steps: int = STEPS, global_batch: int = GLOBAL_BATCH):
    import shardwise

    model = make_model()
    engine, _, _, _ = shardwise.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    x, y = make_data(steps, global_batch)
    micro, gas = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    per_rank = global_batch // world
    losses = []
    for s in range(steps):
        xs = x[s, rank * per_rank : (rank + 1) * per_rank]
        ys = y[s, rank * per_rank : (rank + 1) * per_rank]
        micro_losses = []
        for m in range(gas):
            loss = mse(engine(xs[m * micro : (m + 1) * micro]), ys[m * micro : (m + 1) * micro])
            engine.backward(loss)
            engine.step()
            micro_losses.append(loss.detach())
        step_loss = torch.stack(micro_losses).mean()
        dist.all_reduce(step_loss)
        losses.append(step_loss.item() / world)
    assert engine.global_steps == steps and engine.micro_steps == steps * gas
    params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    return losses, params


def _train_ddp(rank: int, world: int, steps: int = STEPS):
    model = make_model()
    ddp = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
    # fused: the kernel the config's AdamW runs, so stage 0 and DDP can be compared bit for bit
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.01,
                            fused=True)
    x, y = make_data(steps, GLOBAL_BATCH)
    per_rank = GLOBAL_BATCH // world
    losses = []
    for s in range(steps):
        loss = mse(ddp(x[s, rank * per_rank : (rank + 1) * per_rank]), y[s, rank * per_rank : (rank + 1) * per_rank])
        opt.zero_grad()
        loss.backward()
        zero_fill_grads(model)
        opt.step()
        t = loss.detach().clone()
        dist.all_reduce(t)
        losses.append(t.item() / world)
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _parity_body(rank: int, world: int):
    out = {}
    out["gas1"] = _train_shardwise(rank, world, base_config(train_micro_batch_size_per_gpu=GLOBAL_BATCH // world))
    out["gas2"] = _train_shardwise(
        rank, world, base_config(train_micro_batch_size_per_gpu=GLOBAL_BATCH // world // 2, gradient_accumulation_steps=2)
    )
    out["clip"] = _train_shardwise(
        rank, world, base_config(train_micro_batch_size_per_gpu=GLOBAL_BATCH // world, gradient_clipping=0.05)
    )
    out["big_bucket"] = _train_shardwise(
        rank, world,
        base_config(train_micro_batch_size_per_gpu=GLOBAL_BATCH // world, zero_optimization={"stage": 0}),
    )
    out["ddp"] = _train_ddp(rank, world)
    return out


def _assert_close(a, b, *, exact: bool = False):
    (la, pa), (lb, pb) = a, b
    if exact:
        assert la == lb, f"losses differ: {la} vs {lb}"
    else:
        torch.testing.assert_close(torch.tensor(la), torch.tensor(lb), rtol=1e-6, atol=1e-7)
    assert pa.keys() == pb.keys()
    for n in pa:
        if exact:
            assert torch.equal(pa[n], pb[n]), f"parameter {n} differs"
        else:
            torch.testing.assert_close(pa[n], pb[n], rtol=1e-5, atol=1e-6, msg=f"parameter {n}")


def test_stage0_matches_single_process_and_ddp_two_ranks():
    results = run_distributed(_parity_body, 2, timeout=180)
    ref = reference_training(STEPS, GLOBAL_BATCH)
    ref_clip = reference_training(STEPS, GLOBAL_BATCH, clip=0.05)
    r0, r1 = results
    # Every rank holds the same model after every step.
    for key in r0:
        _assert_close(r0[key], r1[key], exact=True)
    # Same losses and parameters as one process on the whole batch (fp32, tight tolerance).
    _assert_close(r0["gas1"], ref)
    _assert_close(r0["big_bucket"], ref)
    _assert_close(r0["clip"], ref_clip)
    # micro-batch 2 x accumulation 2 == micro-batch 4 x accumulation 1
    _assert_close(r0["gas2"], r0["gas1"])
    # Averaging by 2 is exact in binary floating point: bitwise equal to torch DDP.
    _assert_close(r0["gas1"], r0["ddp"], exact=True)
    # Training actually moved the weights (the test could fail).
    start = make_model()
    assert not torch.allclose(start.fc1.weight, r0["gas1"][1]["fc1.weight"])
    # The frozen parameter never moves.
    assert torch.equal(start.frozen, r0["gas1"][1]["frozen"])


def _four_rank_body(rank: int, world: int):
    return _train_shardwise(rank, world, base_config(train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=2))


def test_stage0_matches_single_process_four_ranks_with_accumulation():
    results = run_distributed(_four_rank_body, 4, timeout=180)
    ref = reference_training(STEPS, GLOBAL_BATCH)
    for r in results[1:]:
        _assert_close(results[0], r, exact=True)
    _assert_close(results[0], ref)
