"""DeepCompile's pure-Python pieces through the compat package (compat/deepspeed/deepspeed/compile): the pass
contracts and schedule validation, the compiled-backward capture and its per-engine release, the ZeRO-3
Dynamo-settings ownership, the AOT-autograd constructor patch, the graph helpers and ``fast_free_schedule``,
selective-gather's memory budget, the partitioner's parameter-alias recompute marks, input storage and the
ZeRO-3 eager-fallback bookkeeping.

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


# ------------------------------------------------------------------------------------- the checks

def _check_pass_contracts():
    from deepspeed.compile.passes import offload_parameters, prefetch, zero3_compile, zero_1_and_2_compile
    from deepspeed.compile.passes import contract as c

    saved = dict(c._pass_contracts)
    c._pass_contracts.clear()
    try:
        c.register_pass_contract("z3", c.PassContract(provides=frozenset({"cap"})))
        c.register_pass_contract("user", c.PassContract(requires=frozenset({"cap"})))
        c.validate_schedule([(0, ["z3", "user"]), (3, ["z3", "other", "user"])])
        for bad in ([(0, ["user", "z3"])], [(0, ["z3"]), (1, ["user"])]):  # order matters; no carry-over
            try:
                c.validate_schedule(bad)
                raise AssertionError(f"accepted {bad}")
            except c.PassContractError as e:
                assert "requires" in str(e) and "'user'" in str(e), e
        c.register_pass_contract("a", c.PassContract(conflicts_with=frozenset({"b"})))
        for order in (["a", "b"], ["b", "a"]):  # either side may declare a conflict
            try:
                c.validate_schedule([(0, order)])
                raise AssertionError(f"accepted {order}")
            except c.PassContractError as e:
                assert "conflicts" in str(e), e

        def fn():
            pass

        c.validate_schedule([(0, ["z3", fn])], {"user2": fn})  # an uncontracted callable: unconstrained
        try:
            c.validate_schedule([(0, [fn])], {"x": fn, "y": fn})
            raise AssertionError("an ambiguous callable was accepted")
        except c.PassContractError as e:
            assert "multiple names" in str(e), e
        c.register_pass_contract("user", None)  # None forgets the contract
        assert c.get_pass_contract("user") is None
        c.validate_schedule([(0, ["user"])])

        builtin = {zero3_compile.NAME: zero3_compile.CONTRACT, prefetch.NAME: prefetch.CONTRACT,
                   offload_parameters.NAME: offload_parameters.CONTRACT,
                   zero_1_and_2_compile.NAME_Z1: zero_1_and_2_compile.CONTRACT_Z1}
        for name, contract in builtin.items():
            c.register_pass_contract(name, contract)
        c.validate_schedule([(0, ["zero3_compile", "prefetch", "offload_parameters"])])
        for bad in (["offload_parameters"], ["zero1_compile", "zero3_compile"]):
            try:
                c.validate_schedule([(0, bad)])
                raise AssertionError(f"accepted {bad}")
            except c.PassContractError:
                pass
    finally:
        c._pass_contracts.clear()
        c._pass_contracts.update(saved)


def _check_compiled_backward_capture():
    import torch
    from deepspeed.compile import backend
    from deepspeed.compile.patch_compiled_func import (get_backward_inputs, patch_compiled_func,
                                                       pop_backward_input, register_backward_frame,
                                                       unpatch_compiled_func)

    original = torch.autograd.Function
    mine, other = ("engine-a", 1), ("engine-b", 1)
    backend.frames_needing_bwd.clear()
    backend.frames_needing_bwd.update({mine, other})
    patch_compiled_func()
    try:
        assert torch.autograd.Function is not original
        register_backward_frame(mine)

        class CompiledFunction(torch.autograd.Function):
            compiled_bw = object()

            @staticmethod
            def _backward_impl(ctx, all_args):
                return all_args

            @staticmethod
            def _backward_prologue(ctx, *grad_outputs):
                return grad_outputs

        x = torch.ones(2)
        out = (CompiledFunction._backward_impl(None, (x,)) if hasattr(CompiledFunction, "_backward_impl")
               else CompiledFunction._backward_prologue(None, x))
        assert out[0] is x
        assert len(get_backward_inputs(mine)) == 1 and get_backward_inputs(other) == []
        assert CompiledFunction.compiled_bw is None  # recompiled with the captured inputs
        get_backward_inputs()[other] = [(x,)]

        owned = {mine}
        backend.cleanup_compiled_backward_state(owned_frames=owned)  # an engine lets go of its own frames
        assert owned == set() and backend.frames_needing_bwd == {other}
        assert get_backward_inputs(mine) == [] and torch.autograd.Function is not original
        assert pop_backward_input(other)[0] is x and pop_backward_input(other) is None
        backend.cleanup_compiled_backward_state(frame_id=other)  # the last frame: patch comes off
        assert torch.autograd.Function is original
    finally:
        backend.frames_needing_bwd.clear()
        unpatch_compiled_func()
    assert torch.autograd.Function is original


def _check_engine_gives_back_deepcompile_state():
    import torch
    from deepspeed.compile import backend
    from deepspeed.compile.init_z3 import _allow_dynamo_dynamic_parameter_shapes_for_z3
    from deepspeed.compile.patch_compiled_func import get_backward_inputs, patch_compiled_func
    from deepspeed.runtime.engine import DeepSpeedEngine

    config = torch._dynamo.config
    before = (config.force_parameter_static_shapes, config.force_nn_module_property_static_shapes)
    engines = []
    for owner in ("a", "b"):
        engine = object.__new__(DeepSpeedEngine)
        torch.nn.Module.__init__(engine)
        engine._deepcompile_active = False
        engine._deepcompile_owned_frames = {(owner, 5)}
        engine._deepcompile_dynamo_config_restore = _allow_dynamo_dynamic_parameter_shapes_for_z3({})
        engines.append(engine)
    assert config.force_parameter_static_shapes is False
    backend.frames_needing_bwd.clear()
    backend.frames_needing_bwd.update({("a", 5), ("b", 5)})
    original = torch.autograd.Function
    patch_compiled_func()
    try:
        get_backward_inputs()[("a", 5)] = [()]
        get_backward_inputs()[("b", 5)] = [()]
        engines[0].destroy()
        assert backend.frames_needing_bwd == {("b", 5)} and set(get_backward_inputs()) == {("b", 5)}
        assert config.force_parameter_static_shapes is False  # engine b still owns the settings
        engines[1]._set_deepcompile_active(False)
        assert engines[1].is_deepcompile_active() is False
        assert (config.force_parameter_static_shapes, config.force_nn_module_property_static_shapes) == before
        assert backend.frames_needing_bwd == set() and torch.autograd.Function is original
    finally:
        backend.frames_needing_bwd.clear()
        torch.autograd.Function = original


def _check_init_z3_helpers():
    import torch
    from deepspeed.compile.init_z3 import _resolve_expected_grad_dtype

    p = torch.empty(2, dtype=torch.bfloat16)
    assert _resolve_expected_grad_dtype(p) is torch.bfloat16
    p.grad_dtype = None
    assert _resolve_expected_grad_dtype(p) is None
    p.grad_dtype = torch.float32
    assert _resolve_expected_grad_dtype(p) is torch.float32


def _check_aot_constructor_patch():
    from torch._dynamo.backends.common import AotAutograd
    from deepspeed.compile import inductor

    original = AotAutograd.__init__
    args = dict(graph_id=1, z3_partition=False, make_fw_graph=None, make_bw_graph=None, real_inputs=(),
                param_indices=[], param_manager={}, frame_id=0, frames_partitioned=set())
    first = inductor.patch_create_aot_dispatcher_function(**args)
    second = inductor.patch_create_aot_dispatcher_function(**args)
    newer = AotAutograd.__init__
    first()  # an older restore leaves the newer patch in place
    assert AotAutograd.__init__ is newer
    second()
    second()
    assert AotAutograd.__init__ is original and not hasattr(AotAutograd, "__original_init")

    kwargs = {"fw_compiler": lambda *a: None}
    assert inductor._patch_deepcompile_aot_kwargs(kwargs, **{k: v for k, v in args.items()}) is False
    fw, part = (lambda *a: "fw"), (lambda *a: "part")
    kwargs = {"fw_compiler": fw, "partition_fn": part}
    assert inductor._patch_deepcompile_aot_kwargs(kwargs, **args) is True
    assert kwargs["inference_compiler"] is kwargs["fw_compiler"] and kwargs["fw_compiler"] is not fw
    assert kwargs["bw_compiler"] is not None and kwargs["partition_fn"] is not part


def _define_dc_ops():
    import torch

    try:
        torch.ops.dc.allgather_param.default
        return None
    except (AttributeError, RuntimeError):
        pass
    lib = torch.library.Library("dc", "DEF")
    for schema in ("allgather_param(Tensor a, int graph_id, int id, ScalarType? dtype = None) -> Tensor",
                   "wait_allgather(Tensor(a) a, int graph_id, int id) -> Tensor(a)",
                   "release_param(Tensor(a) a, int graph_id, int id, int n_users) -> Tensor(a)",
                   "reduce_grad(Tensor a, int graph_id, int id) -> Tensor"):
        lib.define(schema)
    return lib


def _check_graph_helpers_and_fast_free_schedule():
    import operator

    import torch
    from torch.fx import Graph
    from deepspeed.compile import list_schedule, util

    lib = _define_dc_ops()  # noqa: F841 -- keeps the op library alive
    dc = torch.ops.dc

    def node(graph, target, args, name, size=0, time=0):
        n = graph.create_node("call_function", target, args, {}, name=name)
        n.meta.update(tensor_size=size, device_time=time)
        return n

    # last uses look through an alias (wait_allgather) to its users
    g = Graph()
    p = g.placeholder("p")
    ag = node(g, dc.allgather_param.default, (p, 0, 1), "allgather_ds_param_p_1")
    wait = node(g, dc.wait_allgather.default, (ag, 0, 1), "wait_allgather_ds_param_p_1")
    use = node(g, operator.neg, (wait,), "use")
    g.output((use,))
    last, dying = util.get_last_uses(g)
    assert last[ag] is use and ag in dying[use]
    assert util.get_real_uses(g)[ag] == [use]

    # two independent parameters, both gathered up front in the input graph: the schedule releases one
    # before gathering the other
    g = Graph()
    params = [g.placeholder(f"w{i}") for i in range(2)]
    gathers = [node(g, dc.allgather_param.default, (w, 0, 10 + i), f"allgather_ds_param_w{i}_{10 + i}", size=4)
               for i, w in enumerate(params)]
    waits = [node(g, dc.wait_allgather.default, (ag, 0, 10 + i), f"wait_allgather_ds_param_w{i}_{10 + i}")
             for i, ag in enumerate(gathers)]
    uses = [node(g, operator.neg, (wait,), f"use{i}", time=1) for i, wait in enumerate(waits)]
    releases = [node(g, dc.release_param.default, (use, 0, 10 + i, 1), f"release_ds_param_w{i}_{10 + i}")
                for i, use in enumerate(uses)]
    g.output(tuple(releases))
    g.lint()
    before = [n.name for n in g.nodes]
    assert before.index(gathers[1].name) < before.index(releases[0].name)
    names = [n.name for n in list_schedule.fast_free_schedule(g, 0, 0, debug_log=False).nodes]
    first, second = sorted(range(2), key=lambda i: names.index(gathers[i].name))
    assert names.index(releases[first].name) < names.index(gathers[second].name), names
    assert len(names) == len(list(g.nodes))


def _check_selective_gather_budget():
    from deepspeed.compile.passes.selective_gather import _compute_persistence_budget

    b = _compute_persistence_budget([[("f", 500, 0, 700)], [], [("b", 600, 10, 650)]], total_mem=1000,
                                    mem_margin=0.1)
    assert b == {"usable_mem": 900, "peak_resident_alloc": 600, "transient_peak": 700, "available_mem": 200,
                 "profiled_list_count": 2}, b
    assert _compute_persistence_budget([[("f", 0, 0, 950)]], 1000, 0.1)["available_mem"] == 0
    assert _compute_persistence_budget([[]], 1000, 0.1)["profiled_list_count"] == 0


def _check_partitioner_recompute_marks():
    import torch
    from torch.fx import Graph
    from torch.utils.checkpoint import CheckpointPolicy
    from deepspeed.compile import partitioner

    g = Graph()
    w = g.placeholder("primals_1")
    x = g.placeholder("primals_2")
    view = g.call_function(torch.ops.aten.view.default, (w, [4]))
    cast = g.call_function(torch.ops.prims.convert_element_type.default, (view, torch.float16))
    act = g.call_function(torch.ops.aten.neg.default, (x,))
    g.output((cast, act))
    partitioner._recompute_param_aliases(g, [(0, 1, torch.Size([4]))])
    assert view.meta["recompute"] == CheckpointPolicy.MUST_RECOMPUTE
    assert cast.meta["recompute"] == CheckpointPolicy.MUST_RECOMPUTE  # a cast of an alias
    assert "recompute" not in act.meta and all(n.meta["ac_graph_id"] == 1 for n in g.nodes)


def _check_input_storage():
    import torch
    from deepspeed.compile.input_storage import InputStorage

    s = InputStorage(keep_int_input_tensors=True)
    assert not s.has_data()
    s.put((torch.zeros(2, 3).t(), torch.tensor([4, 5]), 7, {"k": [torch.ones(1, requires_grad=True)]}))
    t, ids, n, d = s.get()
    assert t.shape == (3, 2) and t.stride() == (1, 3) and ids.tolist() == [4, 5] and n == 7
    assert d["k"][0].requires_grad
    s.clear()
    try:
        s.get()
        raise AssertionError("get() after clear() returned")
    except RuntimeError:
        pass


def _check_eager_fallback_claims():
    from types import SimpleNamespace

    from deepspeed.compile import z3_eager_fallback
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    partitioned = []

    def param(ds_id):
        p = SimpleNamespace(ds_id=ds_id, ds_status=ZeroParamStatus.AVAILABLE, ds_persist=False)
        p.partition = lambda **kw: (partitioned.append(ds_id), setattr(p, "ds_status", ZeroParamStatus.NOT_AVAILABLE))
        return p

    fb = z3_eager_fallback.DeepCompileZ3EagerFallback(engine=None)
    a, b = param(1), param(2)
    fb.record_gathered_param(a)
    g0 = fb.record_forward_graph()  # graph 0 claims a
    fb._current_forward_param_ids.clear()
    fb.record_gathered_param(b)
    g1 = fb.record_forward_graph()  # graph 1 claims b
    fb.record_backward_start(g1)
    fb.complete_backward()
    assert partitioned == [2] and fb.stats()["tracked_param_ids"] == [1]
    fb.record_backward_start(g0)
    fb.complete_backward()
    assert partitioned == [2, 1] and fb.stats()["outstanding_forward_graph_ids"] == []
    other = z3_eager_fallback.DeepCompileZ3EagerFallback(engine=None)
    c = param(3)
    fb.record_gathered_param(c)
    other.record_gathered_param(c)  # a new owner takes the parameter over
    assert fb.stats()["tracked_param_ids"] == [] and other.stats()["tracked_param_ids"] == [3]
    assert not z3_eager_fallback.is_dynamo_guard_evaluation()


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
    return run_compat_probe("import test_deepspeed_compile_passes as t; t._run_all()")


@pytest.mark.parametrize("check", _CHECKS)
def test_deepcompile_compat(compat_results, check):
    assert compat_results.get(check) == "ok", compat_results.get(check, "not run")
