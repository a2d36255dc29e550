"""DeepSpeed's ZeRO-3 gather protocol through the compat package: parameters of DeepSpeed's kind (their own
``all_gather`` / ``partition`` methods) read from a ``ZeROOrderedDict`` in forward, with and without a
DeepCompile eager fallback (deepspeed.compile.z3_eager_fallback) and under Dynamo's guard code; and
``deepspeed.runtime.zero.partition_parameters.GatheredParameters`` over them (one gather / one partition per
context, per-parameter nesting depth, overlapping nests refused before anything is gathered, claims that a
forward graph still holds); shardwise's own partitioned parameters through the same class; and
``deepspeed.runtime.utils.register_output_backward_hooks``.

The checks are the ``_check_*`` functions below; they run together in one subprocess with the compat
package as ``deepspeed`` (its import hook stays out of this process), which prints one JSON verdict each.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from compat_venv import run_compat_probe

REPO = Path(__file__).resolve().parents[1]
COMPAT = REPO / "compat" / "deepspeed"


# ------------------------------------------------------------------------------------- helpers

def _ds_params(*ds_ids, log=None):
    """Parameters of DeepSpeed's kind: released (empty data), gathering to a (2, ds_id) tensor of ds_id."""
    import torch

    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    log = {"gather": [], "partition": []} if log is None else log
    out = []
    for ds_id in ds_ids:
        p = torch.nn.Parameter(torch.empty(0))
        p.ds_id, p.ds_status, p.ds_persist = ds_id, ZeroParamStatus.NOT_AVAILABLE, False

        def all_gather(param_list=None, *, _p=p):
            chosen = [_p] if param_list is None else list(param_list)
            log["gather"].append([q.ds_id for q in chosen])
            for q in chosen:
                q.data = torch.full((2, q.ds_id), float(q.ds_id))
                q.ds_status = ZeroParamStatus.AVAILABLE

        def partition(param_list=None, has_been_updated=False, *, _p=p):
            chosen = [_p] if param_list is None else list(param_list)
            log["partition"].append(([q.ds_id for q in chosen], has_been_updated))
            for q in chosen:
                q.data = torch.empty(0)
                q.ds_status = ZeroParamStatus.NOT_AVAILABLE

        p.all_gather, p.partition = all_gather, partition
        out.append(p)
    return out, log


def _module_with(params, in_forward=True):
    import torch

    from deepspeed.runtime.zero.parameter_offload import ZeROOrderedDict

    module = torch.nn.Module()
    container = ZeROOrderedDict(parent_module=module)
    for i, p in enumerate(params):
        container[f"w{i}"] = p
    container._in_forward = in_forward
    module._parameters = container
    return module


class _Engine:
    """What deepcompile_z3_forward_context asks of an engine."""

    def __init__(self, module):
        from deepspeed.compile.z3_eager_fallback import DeepCompileZ3EagerFallback

        self.module = module
        self._deepcompile_z3_eager_fallback = DeepCompileZ3EagerFallback(self)

    def is_deepcompile_active(self):
        return True

    def zero_optimization_partition_weights(self):
        return True


def _as_guard_code(fn):
    """``fn`` run from a frame that belongs to ``torch._dynamo.guards`` (as Dynamo's guard evaluation does)."""
    from types import FunctionType

    code = compile("result = fn()", "<guard>", "exec")
    scope = {"__name__": "torch._dynamo.guards", "fn": fn}
    FunctionType(code, scope)()
    return scope["result"]


# ------------------------------------------------------------------------------------- the checks

def _check_read_in_forward_gathers_and_registers_external():
    import torch

    from deepspeed.runtime.zero import parameter_offload
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    (p,), log = _ds_params(3)
    module = _module_with([p], in_forward=False)
    assert module._parameters["w0"] is p and log["gather"] == []  # outside forward: nothing gathered
    module._parameters._in_forward = True
    user = torch.nn.Linear(1, 1)
    parameter_offload.FWD_MODULE_STACK.append(user)
    try:
        assert module.w0 is p
    finally:
        parameter_offload.FWD_MODULE_STACK.pop()
    assert log["gather"] == [[3]] and p.ds_status == ZeroParamStatus.AVAILABLE and tuple(p.shape) == (2, 3)
    from shardwise.param_attrs import external_params
    assert any(q is p for q in external_params(user))
    assert module.w0 is p and log["gather"] == [[3]]  # available now: read as is


def _check_fallback_takes_over_gathers_and_guards_gather_nothing():
    from deepspeed.compile import z3_eager_fallback
    from deepspeed.compile.z3_eager_fallback import deepcompile_z3_forward_context
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    (a, b), log = _ds_params(1, 2)
    engine = _Engine(_module_with([a, b], in_forward=False))
    fallback = engine._deepcompile_z3_eager_fallback
    with deepcompile_z3_forward_context(engine):
        assert z3_eager_fallback.get_active_z3_eager_fallback() is fallback
        assert _as_guard_code(lambda: engine.module.w0) is a  # a guard's read: no gather, recorded
        assert log["gather"] == [] and a.ds_status == ZeroParamStatus.NOT_AVAILABLE
        assert fallback.stats()["last_guard_suppressed_param_ids"] == [1]
        assert engine.module.w1 is b  # an eager read: gathered and owned by the fallback
        assert log["gather"] == [[2]] and fallback.stats()["tracked_param_ids"] == [2]
        assert getattr(b, "_ds_z3_eager_fallback_owner") is fallback
    assert z3_eager_fallback.get_active_z3_eager_fallback() is None
    assert not engine.module._parameters._in_forward
    # no forward graph holds b: the next forward partitions it before running
    with deepcompile_z3_forward_context(engine):
        assert b.ds_status == ZeroParamStatus.NOT_AVAILABLE
    assert log["partition"] == [([2], False)] and fallback.stats()["tracked_param_ids"] == []


def _check_forward_graph_claim_outlives_user_context():
    import torch

    from deepspeed.compile.z3_eager_fallback import deepcompile_z3_forward_context
    from deepspeed.runtime.utils import register_output_backward_hooks
    from deepspeed.runtime.zero.partition_parameters import GatheredParameters, ZeroParamStatus

    (p,), log = _ds_params(4)
    engine = _Engine(_module_with([p], in_forward=False))
    x = torch.ones(1, 4, requires_grad=True)
    with deepcompile_z3_forward_context(engine) as fallback:
        loss = torch.nn.functional.linear(x, engine.module.w0).sum()
    graph = {}
    manager = register_output_backward_hooks(loss, preprocess_once_fn=lambda: fallback.record_backward_start(graph["id"]))
    assert manager.hook_handles
    graph["id"] = fallback.record_forward_graph()
    with GatheredParameters([p]):
        assert getattr(p, "_ds_z3_gathered_param_context_depth") == 1
        assert fallback.stats()["context_claimed_param_ids"] == [4]
    # the forward graph still needs p: the context leaves it gathered
    assert log["partition"] == [] and p.ds_status == ZeroParamStatus.AVAILABLE
    assert not hasattr(p, "_ds_z3_gathered_param_context_depth")
    assert fallback.stats()["last_user_adopted_param_ids"] == [4]
    loss.backward()
    assert log["partition"] == []
    fallback.complete_backward()
    assert log["partition"] == [([4], False)] and fallback.stats()["tracked_param_ids"] == []
    assert x.grad is not None and torch.equal(x.grad, torch.full((1, 4), 8.0))


def _check_gathered_parameters_protocol():
    import pytest
    import torch

    from deepspeed.runtime.zero.partition_parameters import GatheredParameters, ZeroParamStatus

    (a, b, c), log = _ds_params(1, 2, 3)
    # one gather over the parameters sorted by ds_id, duplicates dropped; one partition on exit
    with GatheredParameters(iter([c, a, c])):
        assert log["gather"] == [[1, 3]] and tuple(c.shape) == (2, 3)
        assert a._ds_z3_gathered_param_context_depth == 1
        with GatheredParameters([b]):  # disjoint nesting is fine
            assert log["gather"] == [[1, 3], [2]]
        assert log["partition"] == [([2], False)] and b.ds_status == ZeroParamStatus.NOT_AVAILABLE
        # an overlapping nest is refused before it gathers anything
        with pytest.raises(RuntimeError, match=r"cannot overlap parameters.*\[3\]"):
            with GatheredParameters([b, c]):
                raise AssertionError("entered")
        assert log["gather"] == [[1, 3], [2]] and not hasattr(b, "_ds_z3_gathered_param_context_depth")
        assert c._ds_z3_gathered_param_context_depth == 1
    assert log["partition"] == [([2], False), ([1, 3], False)]
    assert all(p.ds_status == ZeroParamStatus.NOT_AVAILABLE for p in (a, b, c))
    assert not any(hasattr(p, "_ds_z3_gathered_param_context_depth") for p in (a, b, c))
    # modifier_rank: partitioned as updated; an exception inside still partitions and unwinds the depth
    with GatheredParameters([a], modifier_rank=0):
        a.data.fill_(5.0)
    assert log["partition"][-1] == ([1], True)
    with pytest.raises(ValueError):
        with GatheredParameters([b]):
            raise ValueError("inside")
    assert log["partition"][-1] == ([2], False) and not hasattr(b, "_ds_z3_gathered_param_context_depth")
    with GatheredParameters([a], enabled=False):
        assert log["gather"][-1] == [2]  # disabled: nothing gathered
    with GatheredParameters([torch.nn.Parameter(torch.ones(2))]):  # no ZeRO parameter: nothing to do
        pass


def _check_gathered_parameters_shardwise_params():
    import torch

    import shardwise
    from deepspeed.runtime.zero.partition_parameters import GatheredParameters, ZeroParamStatus
    from shardwise.zero.partitioned_param import shard_param_

    w = torch.nn.Parameter(torch.arange(6.0).view(2, 3))
    shard_param_(w)  # one process: the shard is the whole tensor
    (d,), log = _ds_params(9)
    assert issubclass(GatheredParameters, shardwise.zero.GatheredParameters)
    with GatheredParameters([w, d]):
        assert torch.equal(w, torch.arange(6.0).view(2, 3)) and w.ds_status == ZeroParamStatus.AVAILABLE
        assert log["gather"] == [[9]]
        assert not hasattr(w, "_ds_z3_gathered_param_context_depth")  # shardwise's parameters keep their own count
    assert tuple(w.shape) == (0, ) and w.ds_status == ZeroParamStatus.NOT_AVAILABLE
    assert log["partition"] == [([9], False)]
    with GatheredParameters(w, modifier_rank=0):
        w.data.mul_(2.0)
    with GatheredParameters([w]):
        assert torch.equal(w, 2 * torch.arange(6.0).view(2, 3))


def _check_output_backward_hooks():
    import torch

    from deepspeed.runtime.utils import OutputBackwardHookManager, register_output_backward_hooks

    x = torch.ones(3, requires_grad=True)
    calls = []
    outs = {"a": x * 2, "b": [x * 3, torch.zeros(1)]}
    manager = register_output_backward_hooks(outs, lambda: calls.append("once"),
                                             preprocess_per_tensor_fn=lambda g: g * 10)
    assert isinstance(manager, OutputBackwardHookManager) and len(manager.hook_handles) == 2
    assert manager in outs["a"]._backward_hook_managers
    (outs["a"].sum() + outs["b"][0].sum()).backward()
    assert calls == ["once"] and torch.equal(x.grad, torch.full((3, ), 50.0))
    assert register_output_backward_hooks(torch.ones(2), lambda: None).hook_handles == []
    manager.remove_hooks()
    assert manager.hook_handles == []


_CHECKS = sorted(name[len("_check_"):] for name in dict(globals()) if name.startswith("_check_"))


def _run_all() -> None:
    """In the subprocess: run every check, print ``{check: "ok" | error}`` as the last line."""
    import traceback

    results = {}
    for name in _CHECKS:
        try:
            globals()["_check_" + name]()
            results[name] = "ok"
        except Exception:  # noqa: BLE001 -- reported to the test
            results[name] = traceback.format_exc()[-2000:]
    print(json.dumps(results))


# ------------------------------------------------------------------------------------ the tests

@pytest.fixture(scope="module")
def compat_results():
    return run_compat_probe("import test_deepspeed_zero3_gather_protocol as t; t._run_all()")


@pytest.mark.parametrize("check", _CHECKS)
def test_zero3_gather_protocol(compat_results, check):
    assert compat_results.get(check) == "ok", compat_results.get(check, "not run")
