"""Public faces of the ZeRO strategies: DeepSpeed's ds_* attributes on ZeRO-3 parameters, the partition
queries, and switching off the gradient reduction (1-bit Adam's ``enable_backward_allreduce``)."""

from __future__ import annotations

import copy

import torch

from distributed import run_distributed, run_subtests
from models import base_config, make_data, make_model, mse


def _ds_attributes(rank, world):
    import shardwise
    from shardwise.zero import GatheredParameters, ZeroParamStatus, full_numel, full_shape, is_partitioned
    from shardwise.zero.partitioned_param import unit_of

    whole = {n: p.detach().clone() for n, p in make_model().named_parameters()}
    model = make_model()
    engine, *_ = shardwise.initialize(model=model, config=base_config(
        train_micro_batch_size_per_gpu=2, zero_optimization={"stage": 3, "stage3_param_persistence_threshold": 0}))
    ids = set()
    for name, p in model.named_parameters():
        assert is_partitioned(p), name
        assert isinstance(p.ds_id, int) and p.ds_id not in ids
        ids.add(p.ds_id)
        assert p.ds_shape == whole[name].shape and full_shape(p) == whole[name].shape
        assert p.ds_numel == whole[name].numel() == full_numel(p)
        chunk = -(-p.ds_numel // world)
        assert p.ds_tensor.shape == (chunk,)
        expected = torch.zeros(chunk)
        own = whole[name].reshape(-1)[rank * chunk:(rank + 1) * chunk]
        expected[: own.numel()] = own
        torch.testing.assert_close(p.ds_tensor.float(), expected, rtol=0, atol=0)
        assert p.ds_status is ZeroParamStatus.NOT_AVAILABLE
    assert not is_partitioned(torch.nn.Parameter(torch.zeros(3)))

    seen = {}  # status of fc1.weight while fc1 runs its forward

    def record(module, args):
        seen.setdefault("fwd", module.weight.ds_status)

    model.fc1.register_forward_pre_hook(record)
    x, y = make_data(1, 4)
    engine.backward(mse(engine(x[0, rank * 2:(rank + 1) * 2]), y[0, rank * 2:(rank + 1) * 2]))
    engine.step()
    assert seen["fwd"] is ZeroParamStatus.AVAILABLE
    assert all(p.ds_status is ZeroParamStatus.NOT_AVAILABLE for p in model.parameters())

    unit = unit_of(model.fc2.weight)
    unit.start_gather()
    assert model.fc2.weight.ds_status is ZeroParamStatus.INFLIGHT
    unit.finish_gather()
    assert all(p.ds_status is ZeroParamStatus.AVAILABLE for p in unit.params)
    unit.release()
    assert model.fc2.weight.ds_status is ZeroParamStatus.NOT_AVAILABLE

    with GatheredParameters([model.out.weight]):
        assert model.out.weight.ds_status is ZeroParamStatus.AVAILABLE
        assert model.out.weight.shape == model.out.weight.ds_shape
    assert model.out.weight.ds_status is ZeroParamStatus.NOT_AVAILABLE


def _local_grads(rank, xs, ys):
    ref = make_model()
    mse(ref(xs), ys).backward()
    return {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}


def _reduction_switch(case, rank, world):
    import shardwise

    model = make_model()
    engine, *_ = shardwise.initialize(model=model, config=base_config(
        train_micro_batch_size_per_gpu=2, zero_optimization={"stage": case}))
    if case != 0:
        try:
            engine.enable_backward_allreduce = False
        except ValueError as exc:
            assert "stage 0" in str(exc)
        else:
            raise AssertionError("switching off the reduction at a partitioned stage must be refused")
        assert engine.enable_backward_allreduce
        return
    assert engine.enable_backward_allreduce
    x, y = make_data(1, 4)
    xs, ys = x[0, rank * 2:(rank + 1) * 2], y[0, rank * 2:(rank + 1) * 2]
    local = _local_grads(rank, xs, ys)
    engine.enable_backward_allreduce = False
    assert engine.enable_backward_allreduce is False
    engine.backward(mse(engine(xs), ys))
    for n, p in model.named_parameters():
        if n in local:  # this rank's own gradient, not the average
            torch.testing.assert_close(p.grad, local[n], rtol=1e-6, atol=1e-7)
    engine.zero_grad()
    engine.enable_backward_allreduce = True
    engine.backward(mse(engine(xs), ys))
    g = model.fc1.weight.grad.clone()
    both = [torch.empty_like(g) for _ in range(world)]
    torch.distributed.all_gather(both, g)
    torch.testing.assert_close(both[0], both[1], rtol=0, atol=0)  # reduced: the same on both ranks
    assert not torch.allclose(g, local["fc1.weight"])


def _body(rank, world):
    _ds_attributes(rank, world)
    run_subtests(_reduction_switch, [0, 2], rank, world)
    return True


def test_zero3_ds_attributes_and_reduction_switch():
    assert run_distributed(_body, 2, timeout=240) == [True, True]
