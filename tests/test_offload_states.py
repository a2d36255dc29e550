"""DeepSpeed's ``engine.offload_states()`` / ``reload_states()`` at ZeRO 1-3 on 2 ranks: the named states
leave their storages (zero bytes held where they were, ``get_state_devices`` says cpu), come back bitwise,
and training after the round trip is bitwise training without it; the calls OpenRLHF makes (on
``engine.optimizer``, with ``engine.config[...]``); bad input gets a named error."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from distributed import run_distributed, run_subtests

HIDDEN = 24
COMPAT = str(Path(__file__).resolve().parents[1] / "compat" / "deepspeed")  # DeepSpeed's paths, from the tree


def _with_compat() -> None:
    if COMPAT not in sys.path:
        sys.path.insert(0, COMPAT)


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.Linear(HIDDEN, 1)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x.to(self.a.weight.dtype)))).squeeze(-1).float()


def _engine(case: dict):
    import shardwise

    zero = {"stage": case["stage"], "reduce_bucket_size": 200, "stage3_param_persistence_threshold": 0,
            "stage3_prefetch_bucket_size": 700}
    zero.update(case.get("zero", {}))
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "zero_optimization": zero}
    if case.get("bf16"):
        cfg["bf16"] = {"enabled": True}
    engine, *_ = shardwise.initialize(model=Net(), config=cfg)
    return engine


def _micro(engine, step: int, rank: int) -> None:
    g = torch.Generator().manual_seed(10 * step + rank)
    x, y = torch.randn(4, HIDDEN, generator=g), torch.randn(4, generator=g)
    engine.backward(((engine(x) - y) ** 2).mean())
    engine.step()


def _snapshot(engine) -> dict:
    """Every state's tensors (copies), by state name, and the master weights."""
    from shardwise.zero.offload_states import OffloadStateTypeEnum, _state_tensors

    return {s.value: [t.detach().clone() for t in _state_tensors(engine, s)] for s in OffloadStateTypeEnum}


def _round_trip(case: dict, rank: int, world: int):
    from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum, OffloadStateTypeEnum
    from deepspeed.runtime.zero.offload_states import get_state_devices

    from shardwise.zero.offload_states import _state_tensors

    include = case.get("include")
    plain, moved = _engine(case), _engine(case)
    for step in range(3):  # one boundary in the middle of the round trip (after a micro-step)
        _micro(plain, step, rank)
        _micro(moved, step, rank)
    before = _snapshot(moved)
    names = [OffloadStateTypeEnum(s) for s in include] if include else list(OffloadStateTypeEnum)
    held = {s: [t for t in _state_tensors(moved, s)] for s in names}
    assert any(held.values()), "no state to offload"
    moved.offload_states(include=include, device=OffloadDeviceEnum.cpu, pin_memory=True, non_blocking=False)
    assert moved.offloaded_states == set(names)
    for s, tensors in held.items():
        if s is OffloadStateTypeEnum.contiguous_grad_buffer:  # the kept buckets are dropped (made again when needed)
            assert not _state_tensors(moved, s)
            continue
        for t in tensors:  # the storage where the state was holds nothing now
            assert t.untyped_storage().nbytes() == 0, f"{s.value}: a storage still holds its bytes"
        if tensors and s is not OffloadStateTypeEnum.contiguous_grad_buffer:
            assert get_state_devices(moved, s) == {torch.device("cpu")}
    if OffloadStateTypeEnum.lp_params in names:  # the weights are away: a forward is refused by name
        with pytest.raises(ValueError, match=r"offloaded .*reload_states\(\) first"):
            moved(torch.zeros(4, HIDDEN))
    else:  # a forward runs (the weights are here); backward needs the rest
        with torch.no_grad():
            moved(torch.zeros(4, HIDDEN))
        with pytest.raises(ValueError, match=r"reload_states\(\) first"):
            moved.backward(torch.zeros((), requires_grad=True))
    ptrs = {s: [t.data_ptr() for t in ts] for s, ts in held.items()}
    moved.reload_states(non_blocking=case.get("non_blocking", False))
    assert moved.offloaded_states == set()
    held.pop(OffloadStateTypeEnum.contiguous_grad_buffer, None)
    for s, tensors in held.items():
        for t, p in zip(tensors, ptrs[s]):
            assert t.untyped_storage().nbytes() > 0
            assert t.data_ptr() != p or p == 0  # new memory
    after = _snapshot(moved)
    for key in before:
        if key == "contiguous_grad_buffer":
            continue
        assert len(before[key]) == len(after[key])
        for a, b in zip(before[key], after[key]):
            assert torch.equal(a, b), f"{key} changed over the round trip"
    for step in range(3, 6):
        _micro(plain, step, rank)
        _micro(moved, step, rank)
    a, b = plain.strategy.module_state_dict(plain.module), moved.strategy.module_state_dict(moved.module)
    for n in a:
        assert torch.equal(a[n], b[n]), f"{n}: training after the round trip differs"
    assert plain.get_global_grad_norm() == moved.get_global_grad_norm()
    return True


def _openrlhf_calls(case: dict, rank: int, world: int):
    """OpenRLHF's ``offload_deepspeed_states`` / ``reload_deepspeed_states`` (openrlhf/utils/deepspeed):
    ``model.config["zero_optimization"]["offload_optimizer"]["device"]``, then the states through
    ``model.optimizer.offload_states(...)``, ``model.empty_partition_cache()``, and ``model.reload_states``."""
    from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum, OffloadStateTypeEnum

    engine = _engine({**case, "zero": {"offload_optimizer": {"device": "none"}}})
    _micro(engine, 0, rank)
    _micro(engine, 1, rank)
    assert engine.config["zero_optimization"]["offload_optimizer"]["device"] != "cpu"
    states = [OffloadStateTypeEnum.optim_states, OffloadStateTypeEnum.contiguous_grad_buffer,
              OffloadStateTypeEnum.hp_params, OffloadStateTypeEnum.lp_grads]
    engine.optimizer.offload_states(include=states, device=OffloadDeviceEnum.cpu, pin_memory=True, non_blocking=True)
    engine.empty_partition_cache()
    with torch.no_grad():  # generation-like forward: the weights are still here
        engine(torch.zeros(2, HIDDEN))
    engine.reload_states(non_blocking=True)
    engine.reload_states()  # (nothing offloaded: nothing to do, as open-r1 calls it)
    _micro(engine, 2, rank)
    return True


CASES = [
    {"stage": 2, "include": ["optim_states", "lp_grads"]},
    {"stage": 3},
    {"stage": 1, "bf16": True, "non_blocking": True},
    {"stage": 2, "bf16": True, "zero": {"reduce_bucket_size": 300}},  # (a kept bucket pool: contiguous_grad_buffer)
    {"stage": 3, "bf16": True, "include": ["hp_params", "lp_params"]},
]


def _body(rank: int, world: int):
    _with_compat()
    out = run_subtests(_round_trip, CASES, rank, world)
    out += run_subtests(_openrlhf_calls, [{"stage": 2}, {"stage": 3, "bf16": True}], rank, world)
    return out, _errors(rank, world)


def test_offload_reload_round_trip_parity_and_errors():
    (done, out), _ = run_distributed(_body, 2, timeout=300)
    assert done == [True] * (len(CASES) + 2)
    _check_errors(out)


def _errors(rank: int, world: int):
    import shardwise
    from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum

    out = {}

    def message(fn):
        try:
            fn()
        except (ValueError, AssertionError, RuntimeError) as e:
            return type(e).__name__, str(e), isinstance(e, AssertionError)
        return None

    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}
    e0, *_ = shardwise.initialize(model=Net(), config={**cfg, "zero_optimization": {"stage": 0}})
    out["stage0"] = message(lambda: e0.offload_states())
    e1, *_ = shardwise.initialize(model=Net(), config={**cfg, "zero_optimization": {"stage": 1}})
    out["name"] = message(lambda: e1.offload_states(include=["optimizer_states"]))
    out["nvme"] = message(lambda: e1.offload_states(device=OffloadDeviceEnum.nvme))
    out["device"] = message(lambda: e1.offload_states(device="gpu"))
    e3, *_ = shardwise.initialize(model=Net(), config={**cfg, "zero_optimization": {
        "stage": 3, "offload_param": {"device": "cpu"}}})
    out["param_offload"] = message(lambda: e3.offload_states())
    e1.destroy()
    out["destroyed"] = message(lambda: e1.offload_states())
    try:
        e1(torch.zeros(2, HIDDEN))
    except RuntimeError as e:
        out["destroyed_forward"] = str(e)
    return out


def _check_errors(out: dict) -> None:
    assert "zero_optimization.stage is 0" in out["stage0"][1]
    assert "'optimizer_states' is not a state DeepSpeed offloads" in out["name"][1] and "optim_states" in out["name"][1]
    assert out["nvme"][1] == "NVMe offload is not supported for offloading states."
    assert "device='gpu'" in out["device"][1]
    # DeepSpeed's assertion wording, and an AssertionError as there (callers catch it by type and text)
    assert out["param_offload"][1].startswith("Moving states across devices is not supported for offloaded parameters.")
    assert out["param_offload"][2]
    assert "destroyed" in out["destroyed_forward"]
