"""DeepSpeed's checkpoint-folder readers, accelerator classes and small layout helpers through the compat
package (compat/deepspeed): ``deepspeed.checkpoint``'s ``DeepSpeedCheckpoint`` / ``ZeROCheckpoint`` /
``model_3d_desc`` (which source files a rank of a smaller layout merges, and the merged ZeRO state), the
``_aggregate_autoep_zero12_metadata`` step of its universal converter, ``deepspeed.utils.bwc``, and the
MLU/SDAA/SUPA/KLXPU accelerator classes.

All checks run in one subprocess (the compat package's import hook stays out of this process).
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from compat_venv import run_compat_probe
from distributed import run_distributed

REPO = Path(__file__).resolve().parents[1]
COMPAT = REPO / "compat" / "deepspeed"

_PROBE = r'''
import json, os, tempfile, traceback
from types import SimpleNamespace
import torch
results = {}

def check(name):
    def run(fn):
        try:
            fn()
            results[name] = "ok"
        except BaseException:
            results[name] = traceback.format_exc()[-2500:]
    return run

def raises(exc, text, fn, *a, **k):
    try:
        fn(*a, **k)
    except exc as e:
        assert text in str(e), (text, str(e))
        return
    raise AssertionError(f"no {exc.__name__} ({text})")

@check("layout_maps")
def _():
    from deepspeed.checkpoint import model_3d_desc
    from deepspeed.checkpoint.reshape_meg_2d import reshape_meg_2d_parallel, get_mpu_ranks
    # pp=2 x tp=2: file i at (i // 2, i % 2); to tp=1 each stage merges its two tensor ranks, to pp=1 each
    # tensor rank merges its two stages
    assert reshape_meg_2d_parallel(2, 2, 2, 1).get_data(1, 0) == [2, 3]
    assert reshape_meg_2d_parallel(2, 2, 1, 2).get_data(0, 1) == [1, 3]
    # 3-D: ZeRO file index = dp * (pp * tp) + mp; to one rank, every file, data copies next to each other
    maps = model_3d_desc(1, 2, 2).reshape(model_3d_desc(1, 1, 1))
    assert len(maps) == 1 and maps[0].get_data(0, 0) == [0, 2, 1, 3]
    maps = model_3d_desc(1, 1, 4).reshape(model_3d_desc(1, 1, 2))
    assert [m.get_data(0, 0) for m in maps] == [[0, 1], [2, 3]]
    ok, errors = model_3d_desc(1, 1, 1).can_reshape(model_3d_desc(2, 1, 1))
    assert not ok and "PP: 1 ---> 2" in errors[0]
    raises(AssertionError, "Expansion", model_3d_desc(1, 1, 1).reshape, model_3d_desc(1, 2, 1))
    tp, pp, dp = get_mpu_ranks(tp_size=2, pp_size=2, dp_size=2)
    assert tp[:2] == [[0, 1], [2, 3]] and dp[:2] == [[0, 2], [1, 3]] and pp[0] == [0, 1, 4, 5]  # one rank of every data group

def _write(folder, mp, dp, dims=None, param_shapes=None, extra=None, optim=None):
    for m in range(mp):
        state = {"param_shapes": param_shapes or [{"w": torch.Size([4])}], "iteration": 7, "ds_config": {}}
        if dims is not None:
            state["checkpoint_parallel_dimensions"] = dims[m] if isinstance(dims, list) else dims
        state.update(extra or {})
        torch.save(state, os.path.join(folder, f"mp_rank_{m:02d}_model_states.pt"))
        for d in range(dp):
            torch.save(optim(d, m) if optim else {},
                       os.path.join(folder, f"zero_pp_rank_{d}_mp_rank_{m:02d}_optim_states.pt"))

@check("checkpoint_folder")
def _():
    from deepspeed.checkpoint import DeepSpeedCheckpoint, ZeROCheckpoint, get_model_3d_descriptor
    from deepspeed.checkpoint.ds_to_universal import _aggregate_autoep_zero12_metadata
    from deepspeed.runtime.engine import _checkpoint_parallel_metadata

    def optim(d, m):  # rank (d, m) holds [10d+m, 10d+m, pad] with one padding element
        v = torch.tensor([10. * d + m] * 2 + [-1.])
        return {"optimizer_state_dict": {"group_paddings": [1], "partition_count": [2],
                                          "base_optimizer_state": {"state": {0: {"exp_avg": v, "step": 3}}}}}

    with tempfile.TemporaryDirectory() as tmp:
        dims = _checkpoint_parallel_metadata(SimpleNamespace(get_tensor_model_parallel_world_size=lambda: 2))
        _write(tmp, mp=2, dp=2, dims=dims["checkpoint_parallel_dimensions"], optim=optim)
        desc = get_model_3d_descriptor(tmp)
        assert (desc.pp_degree, desc.tp_degree, desc.dp_degree) == (1, 2, 2)
        ck = DeepSpeedCheckpoint(tmp, tp_degree=1, dp_degree=1)
        assert (ck.original_world_size, ck.world_size, ck.get_iteration()) == (4, 1, 7)
        assert [os.path.basename(f) for f in ck.get_2d_parallel_files(tp_index=0, pp_index=0)] == [
            "mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt"]
        state = ck.get_zero_checkpoint_state(pp_index=0, tp_index=0, dp_index=0)
        osd = state["optimizer_state_dict"]
        # files (dp0,mp0), (dp1,mp0), (dp0,mp1), (dp1,mp1), padding stripped from each, then concatenated
        assert osd["base_optimizer_state"]["state"][0]["exp_avg"].tolist() == [0, 0, 10, 10, 1, 1, 11, 11]
        assert osd["partition_count"] == [1] and osd["group_paddings"] == [0]
        assert osd["base_optimizer_state"]["state"][0]["step"] == 3
        assert ZeROCheckpoint(tmp).get_src_dp_degree() == 2
        shapes, autoep, ordering = _aggregate_autoep_zero12_metadata(ck.model_state_metadata)
        assert shapes == [{"w": torch.Size([4])}] * 2 and autoep is None and ordering is False

    with tempfile.TemporaryDirectory() as tmp:  # files disagreeing on the layout
        _write(tmp, mp=2, dp=1, dims=[{"pp_degree": 1, "tp_degree": 2}, {"pp_degree": 2, "tp_degree": 1}])
        raises(RuntimeError, "disagrees across model-state files", get_model_3d_descriptor, tmp)
    with tempfile.TemporaryDirectory() as tmp:  # a layout the file count cannot be
        _write(tmp, mp=2, dp=1, dims={"pp_degree": 1, "tp_degree": 4})
        raises(RuntimeError, "file count 2 does not match", get_model_3d_descriptor, tmp)
    with tempfile.TemporaryDirectory() as tmp:  # AutoEP metadata: merged by prefix, conflicts named
        layer = {"expert_key_prefix": "moe.experts", "num_experts": 4}
        _write(tmp, mp=1, dp=1, extra={"ds_autoep_layers": [layer, dict(layer)]})
        ck = DeepSpeedCheckpoint(tmp)
        assert _aggregate_autoep_zero12_metadata(ck.model_state_metadata)[1] == [layer]
        meta = [("a", {"param_shapes": {}, "ds_autoep_layers": [layer], "ds_config": {}}),
                ("b", {"param_shapes": {}, "ds_autoep_layers": [dict(layer, num_experts=8)], "ds_config": {}})]
        raises(RuntimeError, "Conflicting AutoEP metadata for expert_key_prefix 'moe.experts' in a and b",
               _aggregate_autoep_zero12_metadata, meta)
        meta = [("a", {"param_shapes": {}, "ds_autoep_layers": None, "ds_config": {}}),
                ("b", {"param_shapes": {}, "ds_autoep_layers": None,
                       "ds_config": {"use_data_before_expert_parallelism": True}})]
        raises(RuntimeError, "disagrees across model-state files", _aggregate_autoep_zero12_metadata, meta)

@check("bwc")
def _():
    from deepspeed.utils import bwc
    megatron = SimpleNamespace(get_tensor_model_parallel_world_size=lambda: 4, get_tensor_model_parallel_rank=lambda: 3,
                               get_pipeline_model_parallel_world_size=lambda: 2)
    topo = SimpleNamespace(get_slice_parallel_world_size=lambda: 2, get_slice_parallel_rank=lambda: 1,
                           get_pipe_parallel_world_size=lambda: 3)
    old = SimpleNamespace(get_model_parallel_world_size=lambda: 8, get_model_parallel_rank=lambda: 5)
    assert [bwc.bwc_tensor_model_parallel_world_size(m) for m in (None, megatron, topo, old)] == [1, 4, 2, 8]
    assert [bwc.bwc_tensor_model_parallel_rank(m) for m in (None, megatron, topo, old)] == [0, 3, 1, 5]
    assert [bwc.bwc_pipeline_parallel_world_size(m) for m in (None, megatron, topo, old)] == [1, 2, 3, 1]

@check("accelerators")
def _():
    from deepspeed.accelerator.mlu_accelerator import MLU_Accelerator
    from deepspeed.accelerator.sdaa_accelerator import SDAA_Accelerator
    from deepspeed.accelerator.supa_accelerator import SUPA_Accelerator
    from deepspeed.accelerator.klxpu_accelerator import KLXPU_Accelerator
    got = [(a.device_name(), a.communication_backend_name()) for a in
           (MLU_Accelerator(), SDAA_Accelerator(), SUPA_Accelerator(), KLXPU_Accelerator())]
    assert got == [("mlu", "cncl"), ("sdaa", "tccl"), ("supa", "bccl"), ("cuda", "nccl")], got
    assert KLXPU_Accelerator().use_host_timers()

@check("folding_tables")
def _():
    from deepspeed.module_inject.auto_ep_folding import (build_folding_spec, expected_folding_group_tables,
                                                         local_folding_ranks, assert_group_matches_spec,
                                                         validate_folding_global)
    spec = build_folding_spec(world_size=8, pp_size=2, tp_size=2, ep_size=2)
    assert (spec.stage_size, spec.dp_size, spec.edp_size) == (4, 2, 2)
    t = expected_folding_group_tables(spec)
    assert t.tp_groups == ((0, 1), (2, 3), (4, 5), (6, 7)) and t.dense_dp_groups == ((0, 2), (1, 3), (4, 6), (5, 7))
    assert t.ep_groups == t.tp_groups and t.edp_groups == ((0, 2), (1, 3), (4, 6), (5, 7))
    assert local_folding_ranks(6, spec) == {"tp": (6, 7), "dense_dp": (4, 6), "ep": (6, 7), "edp": (4, 6)}
    assert_group_matches_spec({"ep": [[0, 1]], "edp": [[1, 3]]}, spec)
    raises(RuntimeError, "expert-data-parallel group (0, 1)", assert_group_matches_spec, ([], [(0, 1)]), spec)
    raises(ValueError, "Valid autotp_size values: [1, 2, 3, 6]", build_folding_spec, world_size=6, pp_size=1,
           tp_size=4, ep_size=1)
    raises(ValueError, "requires expert_parallel.autoep_size > 1", validate_folding_global,
           build_folding_spec(world_size=4, pp_size=1, tp_size=2, ep_size=1))

@check("dispatch_one_lane")
def _():
    from deepspeed.moe.ep_tp_dispatch import (RoutedAssignmentPayload, assignment_ordinals_by_expert,
                                              partition_assignments, restore_combined, dispatch_counters)
    experts = torch.tensor([3, 3, 1, 1, 1, 0])
    assert assignment_ordinals_by_expert(experts).tolist() == [0, 1, 0, 1, 2, 0]
    tokens = torch.tensor([0, 2, 1, 2, 3, 0])
    weights = torch.tensor([.5, .25, 1., .75, .5, .5], requires_grad=True)
    p = RoutedAssignmentPayload(token_indices=tokens, expert_indices=experts,
                                assignment_indices=assignment_ordinals_by_expert(experts),
                                capacity_slots=torch.tensor([0, 1, 0, 0, 0, 1]), combine_weights=weights,
                                drop_mask=torch.tensor([0, 0, 0, 0, 1, 0], dtype=torch.bool),
                                pad_mask=torch.zeros(6, dtype=torch.bool), input_splits=[1, 3, 0, 2],
                                output_splits=[1, 3, 0, 2], extra={"destination_ranks": experts, "num_tokens": 4})
    local, ctx = partition_assignments(p, tp_group=None, tp_rank=0, tp_size=1)
    assert local.input_splits == [1, 2, 0, 2] and dispatch_counters(ctx)["dropped"] == 1
    values = torch.randn(5, 3, requires_grad=True)
    out = restore_combined(values, ctx, tp_group=None)
    want = torch.zeros(4, 3)
    for row, tok, w in zip(values, local.token_indices, local.combine_weights):
        want[tok] += row * w
    assert out.shape == (4, 3) and torch.allclose(out, want)
    out.sum().backward()
    assert weights.grad[4] == 0 and weights.grad[0] != 0  # the dropped assignment takes no part

@check("resource_filter")
def _():
    from deepspeed.launcher.runner import parse_resource_filter
    hosts = {"a": [0, 1, 2], "b": [0, 1]}
    assert parse_resource_filter(hosts, exclude_str="a:1@b") == {"a": [0, 2]}
    assert parse_resource_filter(hosts, exclude_str="a@b") == {}  # the filter leaves nothing; the launcher refuses
    assert parse_resource_filter(hosts, include_str="b:1") == {"b": [1]}
    raises(ValueError, "unknown host 'c'", parse_resource_filter, hosts, exclude_str="c")

@check("autotp_autoep_layers")
def _():
    from torch import nn
    from deepspeed.module_inject.auto_tp import AutoTP
    from shardwise.tensor_parallel.autotp_layers import LinearLayer as SwLinear

    def mlp():
        m = nn.Module()
        m.gate_proj, m.up_proj, m.down_proj = nn.Linear(8, 16), nn.Linear(8, 16), nn.Linear(16, 8)
        return m

    class AutoEPLike(nn.Module):
        def __init__(self):
            super().__init__()
            self._is_autoep_layer = True
            self.experts = nn.ModuleList([mlp(), mlp()])  # routed: expert-parallel, never split by AutoTP
            self.shared_experts = mlp()
            self.shared_experts_gate = nn.Linear(8, 1)

    model = nn.Module()
    model.mlp, model.moe = mlp(), AutoEPLike()
    tp = AutoTP(model, [], "", None, None, None)
    tp.set_tensor_parallel_config(1, None)
    assert tp._replace_module(model) is model
    assert isinstance(model.mlp.gate_proj, SwLinear) and isinstance(model.moe.shared_experts.up_proj, SwLinear)
    assert model.moe.shared_experts.up_proj.name == "moe.shared_experts.up_proj"  # its full path
    assert all(type(e.gate_proj) is nn.Linear for e in model.moe.experts)
    assert type(model.moe.shared_experts_gate) is nn.Linear and isinstance(model.moe, AutoEPLike)

print(json.dumps(results))
'''

_CHECKS = ("layout_maps", "checkpoint_folder", "bwc", "accelerators", "folding_tables", "dispatch_one_lane",
           "resource_filter", "autotp_autoep_layers")


@pytest.fixture(scope="module")
def compat_results():
    return run_compat_probe(_PROBE)


@pytest.mark.parametrize("check", _CHECKS)
def test_compat_deepspeed_layouts(compat_results, check):
    assert compat_results.get(check) == "ok", compat_results.get(check, "not run")


def _two_lane_body(rank: int, world: int, compat: str, repo: str):
    """Two tensor lanes each keep half the assignments; the restore must give both lanes the whole sum, and
    the lanes' summed gradients must be those of the unsplit computation."""
    sys.path[:0] = [compat, repo]  # this process only: the compat package as `deepspeed`
    import torch.distributed as tdist
    from deepspeed.moe.ep_tp_dispatch import (RoutedAssignmentPayload, assert_tp_payload_consistent,
                                              assignment_ordinals_by_expert, partition_assignments, restore_combined)

    def payload(weights):
        experts = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2])
        return RoutedAssignmentPayload(
            token_indices=torch.tensor([0, 1, 2, 0, 3, 1, 2, 3, 4]), expert_indices=experts,
            assignment_indices=assignment_ordinals_by_expert(experts), capacity_slots=torch.arange(9) % 2,
            combine_weights=weights, drop_mask=torch.zeros(9, dtype=torch.bool), pad_mask=torch.zeros(9, dtype=torch.bool),
            input_splits=[3, 2, 4], output_splits=[3, 2, 4], extra={"destination_ranks": experts, "num_tokens": 5})

    torch.manual_seed(0)
    full_values, full_weights = torch.randn(9, 4), torch.rand(9)
    ref_v, ref_w = full_values.clone().requires_grad_(True), full_weights.clone().requires_grad_(True)
    _, ref_ctx = partition_assignments(payload(ref_w), tp_group=None, tp_rank=0, tp_size=1)
    ref = restore_combined(ref_v, ref_ctx, tp_group=None)
    ref_loss = sum((ref * (r + 1)).square().sum() for r in range(world))
    ref_loss.backward()

    v, w = full_values.clone().requires_grad_(True), full_weights.clone().requires_grad_(True)
    group = tdist.group.WORLD
    local, ctx = partition_assignments(payload(w), tp_group=group, tp_rank=rank, tp_size=world)
    assert_tp_payload_consistent(payload(w), tp_group=group, tp_size=world)
    out = restore_combined(v.index_select(0, ctx.local_indices), ctx, tp_group=group, validate_coverage=True)
    (out * (rank + 1)).square().sum().backward()
    grads = [v.grad.clone(), w.grad.clone()]
    for g in grads:
        tdist.all_reduce(g)
    diverged = None
    try:
        bad = payload(full_weights + rank)  # lane 1 routes differently
        assert_tp_payload_consistent(bad, tp_group=group, tp_size=world)
    except RuntimeError as e:
        diverged = str(e)
    return {"local": local.token_indices.numel(), "out_ok": bool(torch.allclose(out, ref.detach(), atol=1e-6)),
            "v_ok": bool(torch.allclose(grads[0], ref_v.grad, atol=1e-5)),
            "w_ok": bool(torch.allclose(grads[1], ref_w.grad, atol=1e-5)), "diverged": diverged}


def test_dispatch_two_lanes_matches_unsplit():
    outs = run_distributed(_two_lane_body, 2, args=(str(COMPAT), str(REPO)))
    assert sorted(o["local"] for o in outs) == [4, 5]  # each assignment on exactly one lane
    for o in outs:
        assert o["out_ok"] and o["v_ok"] and o["w_ok"], o
        assert "routing decisions differ" in (o["diverged"] or ""), o


def test_offload_host_buffers_are_pooled_by_shape():
    """shardwise's activation offload reuses its host buffers: a buffer given back is what the next copy of
    that shape and dtype gets (whatever the source's strides), the pool holds at most
    ``max_cpu_buffer_pool_count`` buffers, and a new buffer is pinned through the accelerator."""
    from shardwise.accelerator import get_accelerator
    from shardwise.runtime.activation_checkpointing.offload_activations import CheckpointHiddenStatesOffload, _Saved

    off = CheckpointHiddenStatesOffload(use_pin_memory=False, min_offload_bytes=0, keep_last_count=0,
                                        max_cpu_buffer_pool_count=1)
    off._copy_cpu_tensors = True
    dense, strided = torch.randn(6, 4), torch.randn(6, 8)[:, ::2]
    assert off._buffer_key(dense) == off._buffer_key(strided) != off._buffer_key(dense.double())
    first = _Saved(dense)
    off._to_host(first)
    assert torch.equal(first.host, dense) and first.host.is_contiguous()
    off._give_back(first.key, first.host)
    off._give_back(first.key, torch.empty(6, 4))  # over the limit: dropped
    assert off._pool_count == 1
    second = _Saved(strided)
    off._to_host(second)
    assert second.host is first.host and torch.equal(second.host, strided) and off._pool_count == 0

    calls = []
    acc = get_accelerator()
    real = acc.pin_memory
    acc.pin_memory = lambda t, **kw: (calls.append(kw), real(t, **kw))[1]
    try:
        pinned = CheckpointHiddenStatesOffload(use_pin_memory=True, min_offload_bytes=0)
        buf, key = pinned._empty_cpu_like(strided)
        assert calls == [{"make_copy": False}] and buf.shape == strided.shape and key[-1] is True
    finally:
        acc.pin_memory = real


def test_contiguous_checkpointing_asks_for_the_layer_count_first():
    """DeepSpeed's configure asserts a layer count for contiguous checkpointing of partitioned activations;
    shardwise reports that first, then refuses the (not implemented) contiguous buffers."""
    from shardwise import checkpointing

    saved = checkpointing._settings, checkpointing._configured
    try:
        with pytest.raises(AssertionError, match="number of layers"):
            checkpointing.configure(None, partition_activations=True, contiguous_checkpointing=True)
        with pytest.raises(ValueError, match="not implemented yet: activation_checkpointing.contiguous"):
            checkpointing.configure(None, partition_activations=True, contiguous_checkpointing=True, num_checkpoints=4)
    finally:
        checkpointing._settings, checkpointing._configured = saved


def _zero3_dict_body(rank: int, world: int, compat: str, repo: str):
    sys.path[:0] = [compat, repo]  # this process only: the compat package as `deepspeed`
    import deepspeed
    from deepspeed.runtime.zero.parameter_offload import ZeROOrderedDict

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    ref = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    ref.load_state_dict(model.state_dict())
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    engine, *_ = deepspeed.initialize(model=model, config=cfg, model_parameters=model.parameters())
    out = {"injected": all(isinstance(m._parameters, ZeROOrderedDict) for m in engine.module.modules())}
    first = engine.module[0]._parameters
    x = torch.randn(2, 8)
    out["same_output"] = bool(torch.allclose(engine(x), ref(x), atol=1e-6))
    out["kept"] = engine.module[0]._parameters is first
    late = torch.nn.Linear(4, 4)
    late._parameters = dict(late._parameters)
    engine.module.add_module("late", late)
    engine(x)
    out["late"] = isinstance(late._parameters, ZeROOrderedDict) and late._original_parameters is not late._parameters
    fc = engine.module[2]
    out["released"] = fc.weight.numel() == 0
    fc._parameters._in_forward = True  # as while fc's forward runs: reading a released weight gathers it
    try:
        out["gathered"] = bool(torch.equal(fc.weight, ref[2].weight))
    finally:
        fc._parameters._in_forward = False
    return out


def test_zero3_parameter_containers_are_zero_ordered_dicts():
    """Under ``deepspeed.initialize`` with ZeRO-3 every module's ``_parameters`` is DeepSpeed's ZeROOrderedDict
    (a module attached later too, before the next forward); the model computes the same, and a released
    parameter read while its module's forward is flagged is gathered."""
    out = run_distributed(_zero3_dict_body, 1, args=(str(COMPAT), str(REPO)))[0]
    assert out == {"injected": True, "same_output": True, "kept": True, "late": True, "released": True,
                   "gathered": True}, out


def _clip_body(rank: int, world: int, compat: str, repo: str):
    """DeepSpeed's stand-alone clip_grad_norm_ without any grid: the norm is averaged over the whole world."""
    sys.path[:0] = [compat, repo]
    from deepspeed.runtime.utils import clip_grad_norm_

    p1, p2 = torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))
    p1.grad, p2.grad = torch.ones(1), torch.full((1,), float(rank + 1))
    return float(clip_grad_norm_([p1, p2], max_norm=0.1))


def test_clip_grad_norm_without_a_grid_averages_over_the_world():
    norms = run_distributed(_clip_body, 2, args=(str(COMPAT), str(REPO)))
    local = [(1 + (r + 1) ** 2) ** 0.5 for r in range(2)]  # each rank's own norm
    assert norms[0] == norms[1]
    assert abs(norms[0] - sum(local) / 2) < 1e-6, (norms, local)
