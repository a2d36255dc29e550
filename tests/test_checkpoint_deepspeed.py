"""Resuming from DeepSpeed's own checkpoints (docs/checkpoints.md, "From DeepSpeed").

* Real checkpoints: tests/fixtures/deepspeed/zero{2,3} were written by DeepSpeed 0.19.8 itself
  (make_fixtures.py, command in the README there) with the losses and learning rates of its own
  continuation.  Loaded at the same layout, at 2 ranks / another stage and at 1 rank / ZeRO-0,
  shardwise continues with those losses and learning rates.
* Layout coverage: ``ds_layout.py`` writes DeepSpeed-layout folders (ZeRO 0-3, fp32/fp16/bf16,
  several param groups, odd sizes, 3 ranks) from known weights and Adam states, following
  DeepSpeed's source; converting them must give back exactly those values.
* Pipelines: tests/fixtures/deepspeed/pipeline_zero{0,1,1_dp2} (DeepSpeed's PipelineModule, 2 stages,
  data-parallel size 1 or 2) continue with DeepSpeed's losses in shardwise's 2-stage PipelineEngine
  and (ZeRO-1's, at ZeRO-2) in an nn.Sequential of the same layers trained data-parallel.
* Security and errors: a pickle naming ``os.system`` is refused unexecuted; tensor-parallel checkpoints,
  layout changes, missing rank files and missing or damaged pipeline layer files are errors that name
  what is wrong.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import ds_layout
from distributed import run_distributed, run_subtests
from shardwise.checkpoint.deepspeed_format import DeepSpeedLayoutError
from shardwise.checkpoint.deepspeed_import import convert_deepspeed_checkpoint
from shardwise.checkpoint.fragments import FragmentReader
from shardwise.checkpoint.manifest import open_checkpoint
from shardwise.checkpoint.safe_unpickle import RefusedPickle
from shardwise.checkpoint.serialize import join_state

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "deepspeed"
_spec = importlib.util.spec_from_file_location("deepspeed_fixture_model", FIXTURES / "model.py")
ds_model = importlib.util.module_from_spec(_spec)  # the fixtures' model, data and DeepSpeed config
_spec.loader.exec_module(ds_model)

# fp32 on both sides. Observed: losses bitwise equal to DeepSpeed's at 2 ranks, within 1e-7 relative at one
# rank (another order of the floating-point sums); learning rates exactly equal.
LOSS_RTOL, LR_RTOL = 1e-6, 1e-12


def _continue_from_deepspeed(case, rank, world):
    """Load a real DeepSpeed fixture into a shardwise engine at (world, stage) and train on."""
    import shardwise

    fixture, stage = case
    record = json.loads((FIXTURES / fixture / "continuation.json").read_text())
    options = dict(record.get("config", {}))  # what DeepSpeed ran with (bf16, offload)
    if stage != 3:
        options.pop("offload", None)
    bf16 = options.get("dtype") == "bf16"
    cfg = ds_model.ds_config(stage, **options)
    cfg["train_micro_batch_size_per_gpu"] = ds_model.MICRO * 2 // world
    model = ds_model.TinyNet()  # other initial weights than DeepSpeed's: the load must replace them
    engine, *_ = shardwise.initialize(model=model, model_parameters=[p for p in model.parameters()
                                                                     if p.requires_grad], config=cfg)
    path, client = engine.load_checkpoint(str(FIXTURES / fixture))
    if bf16:  # DeepSpeed 0.19.8 casts parameters only (buffers unless data_types.buffer_dtype); shardwise all
        engine.module.shift.data = ds_model.TinyNet().shift
    assert Path(path) == FIXTURES / fixture / "global_step3"  # (universal folders: from latest_universal)
    assert client["epoch"] == 2 and client["note"] == "from deepspeed"
    assert torch.equal(client["counts"], torch.arange(3))
    assert (engine.global_steps, engine.global_samples) == (3, 24)
    assert engine.get_lr()[0] == pytest.approx(record["before"][-1]["lr"], rel=LR_RTOL)
    got = []
    for entry in record["continuation"]:
        x, y = ds_model.global_batch(entry["step"])
        m = x.shape[0] // world
        x = x.to(torch.bfloat16) if bf16 else x
        loss = ds_model.loss_fn(engine(x[rank * m:(rank + 1) * m]).float(), y[rank * m:(rank + 1) * m])
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        if world > 1:
            dist.all_reduce(total)
        got.append((total.item() / world, engine.get_lr()[0]))
    want = [(e["loss"], e["lr"]) for e in record["continuation"]]
    for (gl, glr), (wl, wlr), e in zip(got, want, record["continuation"]):
        assert gl == pytest.approx(wl, rel=LOSS_RTOL), f"step {e['step']}: loss {gl} vs DeepSpeed's {wl}"
        assert glr == pytest.approx(wlr, rel=LR_RTOL), f"step {e['step']}: lr {glr} vs DeepSpeed's {wlr}"
    return got


def _pipeline_layers(pipe):
    """make_fixtures.PIPE_LAYERS: Linear(5, 7), Tanh, Linear(7, 6), Tanh, Linear(6, 3)."""
    sizes = [(5, 7), None, (7, 6), None, (6, 3)]
    if pipe:
        from shardwise.pipe import LayerSpec

        return [LayerSpec(torch.nn.Linear, *s) if s else torch.nn.Tanh() for s in sizes]
    return [torch.nn.Linear(*s) if s else torch.nn.Tanh() for s in sizes]


def _continue_from_deepspeed_pipeline(case, rank, world, tmp):
    """DeepSpeed's 2-stage PipelineModule checkpoint (layer files; per stage a ZeRO-1 optimizer, or at
    ZeRO-0 the optimizer in its model states) into shardwise's 2-stage PipelineModule, or into the same
    layers as an nn.Sequential (names "<i>.weight" too) trained data-parallel at 2 ranks, at ZeRO
    ``stage``: each step is the same 8 samples, 2 micro-batches of 4."""
    import shardwise
    from shardwise.pipe import PipelineModule

    fixture, pipe, stage = case
    record = json.loads((FIXTURES / fixture / "continuation.json").read_text())
    cfg = ds_model.ds_config(stage)
    if pipe:
        cfg["gradient_accumulation_steps"] = 2
        if fixture == "pipeline_tied":  # a Linear tied between stage 0's first layer and stage 1's head
            from shardwise.pipe import LayerSpec, TiedLayerSpec

            layers, cut = ds_model.tied_pipeline_layers(LayerSpec, TiedLayerSpec), "uniform"
        else:
            layers, cut = _pipeline_layers(True), "parameters"  # another cut than DeepSpeed's 0-2 | 3-4
        model = PipelineModule(layers, num_stages=2, loss_fn=ds_model.loss_fn, partition_method=cut)
    else:
        model = torch.nn.Sequential(*_pipeline_layers(False))
    engine, *_ = shardwise.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    path, client = engine.load_checkpoint(str(FIXTURES / fixture))
    assert Path(path) == FIXTURES / fixture / "global_step3"
    assert client["epoch"] == 2 and torch.equal(client["counts"], torch.arange(3))
    assert (engine.global_steps, engine.global_samples) == (3, 24)
    if pipe and fixture == "pipeline_zero1":  # a strict load names the stage's missing layers and their file
        import shutil

        damaged = Path(tmp) / "no_layer_04"
        if rank == 0:
            shutil.copytree(FIXTURES / "pipeline_zero1", damaged)
            (damaged / "global_step3" / "layer_04-model_states.pt").unlink()
        dist.barrier()
        with pytest.raises(ValueError, match=r"lacks layers of pipeline stage 1: 4\.bias, 4\.weight \(DeepSpeed's "
                                             r"layer files layer_04-model_states\.pt are missing or lack them\)"):
            engine.load_checkpoint(str(damaged))
    got = []
    for entry in record["continuation"]:
        micro = [ds_model.batch(entry["step"], r) for r in range(2)]
        if pipe:
            loss = float(engine.train_batch(iter(micro)))
        else:
            x, y = micro[rank]
            out = ds_model.loss_fn(engine(x), y)
            engine.backward(out)
            engine.step()
            total = out.detach().clone()
            dist.all_reduce(total)
            loss = total.item() / world
        got.append((loss, engine.get_lr()[0]))
    if fixture == "pipeline_tied":
        # DeepSpeed 0.19.8's train_batch does not reproduce its own saved (and live) weights' loss with a tied
        # head (docs/checkpoints.md), so the first continued step is checked against those weights' plain
        # forward, the learning rates against DeepSpeed's.
        assert got[0][0] == pytest.approx(_tied_forward_loss(record["continuation"][0]["step"]), rel=1e-6)
        assert [lr for _, lr in got] == pytest.approx([e["lr"] for e in record["continuation"]], rel=LR_RTOL)
        return got
    for (gl, glr), e in zip(got, record["continuation"]):
        assert gl == pytest.approx(e["loss"], rel=LOSS_RTOL), f"step {e['step']}: loss {gl} vs DeepSpeed's {e['loss']}"
        assert glr == pytest.approx(e["lr"], rel=LR_RTOL), f"step {e['step']}: lr {glr} vs DeepSpeed's {e['lr']}"
    return got


def _tied_forward_loss(step: int) -> float:
    """The mean loss of ``step``'s two micro-batches through pipeline_tied's saved weights, computed by hand:
    the tied Linear (layer_00's file) in, Tanh, layer 2, Tanh, the tied Linear again (first 3 outputs)."""
    from shardwise.checkpoint.safe_unpickle import load_deepspeed_file

    folder = FIXTURES / "pipeline_tied" / "global_step3"
    io, mid = (load_deepspeed_file(folder / f"layer_{i:02d}-model_states.pt") for i in (0, 2))
    lin = torch.nn.functional.linear
    losses = []
    for x, y in (ds_model.batch(step, r) for r in range(2)):
        h = torch.tanh(lin(torch.tanh(lin(x, io["weight"], io["bias"])), mid["weight"], mid["bias"]))
        losses.append(ds_model.loss_fn(lin(h, io["weight"], io["bias"])[..., :3], y).item())
    return sum(losses) / len(losses)


def _two_ranks(rank, world, tmp):
    # same layout as saved, and the other sharding (ZeRO-2 -> ZeRO-3, ZeRO-3 -> ZeRO-1)
    # FusedAdam's / DeepSpeedCPUAdam's int steps, the bf16 optimizer's bf16_ files, ZeRO-3 with offload
    # DeepSpeed pipelines (2 stages, data-parallel size 1 or 2) into shardwise's (data-parallel size 1)
    # and into a plain nn.Sequential
    run_subtests(_continue_from_deepspeed_pipeline, [("pipeline_zero1", True, 1), ("pipeline_zero1", False, 2),
                                                     ("pipeline_zero0", True, 0), ("pipeline_zero1_dp2", True, 1),
                                                     ("pipeline_tied", True, 0)],  # shardwise ties stages at ZeRO-0
                 rank, world, tmp)
    return run_subtests(_continue_from_deepspeed, [("zero2", 2), ("zero2", 3), ("zero3", 3), ("zero3", 1),
                                                   ("zero2_fusedadam", 2), ("zero1_bf16", 1), ("zero3_offload", 3),
                                                   ("zero3_offload_cpuadam", 2), ("zero2_universal", 2),
                                                   ("zero3_universal", 3)], rank, world)


def _one_rank(rank, world, tmp):
    run_subtests(_load_written_layout, ["z2-fp16-w3", "z3-bf16-w3", "z0-fp16-unfused"], rank, world, tmp)
    return run_subtests(_continue_from_deepspeed, [("zero2", 0), ("zero3", 0)], rank, world)


def _load_written_layout(layout, rank, world, tmp):
    """A written DeepSpeed-layout folder through engine.load_checkpoint: weights, moments, step,
    loss scaler, counters, learning rate and client_state come back."""
    import shardwise
    from shardwise.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    stage, ds_world, dtype, options, scaler = LAYOUTS[layout]
    src = ds_layout.make_source(stage, groups=1, scheduler=False, scaler=scaler)
    ds_layout.write(Path(tmp) / layout, src, stage=stage, world=ds_world, dtype=dtype, **options)
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 0.5}},
           "zero_optimization": {"stage": 0}}
    if dtype == F16:
        cfg["fp16"] = {"enabled": True, "hysteresis": 2}
    elif dtype == BF16:
        cfg["bf16"] = {"enabled": True}
    engine, *_ = shardwise.initialize(model=ds_layout.SynthNet(), config=cfg)
    _, client = engine.load_checkpoint(str(Path(tmp) / layout))
    assert client["epoch"] == 3 and client["pos"] == (1, 2) and torch.equal(client["t"], torch.arange(4.0))
    assert (engine.global_steps, engine.global_samples, engine.skipped_steps) == (5, 40, 1)
    assert engine.get_lr() == [src.hyper[0]["lr"]]
    if dtype == F16:
        assert engine.cur_scale == scaler.cur_scale
        assert engine.loss_scaler.state_dict()["cur_iter"] == scaler.cur_iter
    for name in TRAINABLE:
        p = engine.module.get_parameter(name)
        assert torch.equal(safe_get_full_fp32_param(p), src.weights[name]), name
        assert torch.equal(p.detach(), src.weights[name].to(dtype)), name
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(safe_get_full_optimizer_state(p, key), src.moments[name][key]), f"{name}/{key}"
    assert engine.module.head.weight is engine.module.emb.weight
    assert torch.equal(engine.module.frozen.detach(), src.weights["frozen"].to(dtype))
    steps = {float(st["step"]) for st in engine.optimizer.state.values()}
    assert steps == {5.0}


def test_real_deepspeed_checkpoints_continue_at_two_ranks(tmp_path):
    run_distributed(_two_ranks, 2, args=(str(tmp_path),), timeout=240)


def test_deepspeed_checkpoints_load_at_one_rank_zero0(tmp_path):
    run_distributed(_one_rank, 1, args=(str(tmp_path),), timeout=120)


# --------------------------------------------------------------------------------------------
# Layout coverage: DeepSpeed-layout folders written from known values (tests/ds_layout.py)

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
TRAINABLE = ["emb.weight", "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
LAYOUTS = {  # id: (stage, world, dtype, writer options, scaler)
    "z0-fp32": (0, 1, F32, {}, None),
    "z0-fp16-unfused": (0, 1, F16, {}, ds_layout.DynamicLossScaler(256.0, 9, 4, 1)),
    "z0-fp16-fused": (0, 1, F16, {"fused_fp16": True}, ds_layout.LossScaler(64.0)),
    "z0-bf16": (0, 1, BF16, {}, None),
    "z1-fp32-w2": (1, 2, F32, {}, None),
    "z1-bf16-w3": (1, 3, BF16, {}, None),  # BF16_Optimizer: bf16_ files, padding kept
    "z2-fp16-w3": (2, 3, F16, {}, ds_layout.DynamicLossScaler(512.0, 7, 3, 2)),
    "z2-fp32-w2-elastic": (2, 2, F32, {"elastic": True}, None),
    "z3-bf16-w3": (3, 3, BF16, {"sub_groups": 4}, None),
    "z3-fp16-w2": (3, 2, F16, {}, ds_layout.LossScaler(32.0)),
}


def _read_whole(ckpt, entry, numel):
    return FragmentReader(ckpt).read_range(entry, 0, numel, what="test")


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_converts_to_the_saved_values(layout, tmp_path):
    stage, world, dtype, options, scaler = LAYOUTS[layout]
    src = ds_layout.make_source(stage, scaler=scaler)
    ds_layout.write(tmp_path / "ds", src, stage=stage, world=world, dtype=dtype, **options)
    folder = convert_deepspeed_checkpoint(tmp_path / "ds", tmp_path / "native", param_names=TRAINABLE)
    assert folder == tmp_path / "native" / "global_step5"
    assert (tmp_path / "native" / "latest").read_text() == "global_step5"
    ckpt = open_checkpoint(tmp_path / "native")
    ckpt.verify()
    m = ckpt.manifest
    masters, optim = m["tensors"]["master"], m["tensors"]["optim"]
    model = ckpt.read("model.safetensors")
    for name in TRAINABLE:
        w = src.weights[name]
        if dtype != F32 or stage > 0:  # an fp32 copy exists: the master fragments, whole and exact
            assert torch.equal(_read_whole(ckpt, masters[name], w.numel()).view(w.shape), w), name
        else:
            assert name not in masters
        assert torch.equal(model[name], w.to(dtype)), f"module weight {name}"
        for key in ("exp_avg", "exp_avg_sq"):
            got = _read_whole(ckpt, optim[f"{name}/{key}"], w.numel()).view(w.shape)
            assert torch.equal(got, src.moments[name][key]), f"{name}/{key}"
        assert optim[f"{name}/step"].get("scalar") and \
            _read_whole(ckpt, optim[f"{name}/step"], 1).item() == 5.0
    assert torch.equal(model["frozen"], src.weights["frozen"].to(dtype))
    assert torch.equal(model["norm"], src.buffers["norm"])
    assert m["aliases"] == {"head.weight": "emb.weight"} and "head.weight" not in model
    assert "head.weight" in m["module_keys"]
    if stage > 0:
        assert m["frozen"] == ["frozen"]
    eng = m["engine"]
    assert (eng["global_steps"], eng["micro_steps"], eng["skipped_steps"], eng["global_samples"]) == (5, 10, 1, 40)
    assert eng["param_dtype"] == str(dtype).removeprefix("torch.")
    if dtype != F16:
        assert eng["loss_scaler"] is None
    elif scaler.dynamic:
        assert eng["loss_scaler"] == {"type": "dynamic", "cur_scale": scaler.cur_scale, "cur_iter": scaler.cur_iter,
                                      "last_overflow_iter": scaler.last_overflow_iter,
                                      # ZeRO-0's FP16 optimizers do not save it: the config's hysteresis
                                      "cur_hysteresis": scaler.cur_hysteresis if stage > 0 else 2}
    else:
        assert eng["loss_scaler"] == {"type": "static", "cur_scale": scaler.cur_scale}
    groups = [join_state(g, {}) for g in m["optimizer"]["param_groups"]]
    if options.get("elastic"):  # elastic_checkpoint saves no param groups: the config's settings, one per group
        assert groups == [{"lr": 0.02, "betas": (0.9, 0.95)}] * len(src.groups)
    else:
        assert [g["lr"] for g in groups] == [h["lr"] for h in src.hyper]
        assert [g["weight_decay"] for g in groups] == [h["weight_decay"] for h in src.hyper]
        assert groups[0]["betas"] == (0.9, 0.999)
    extra = ckpt.read("extra.safetensors")
    assert join_state(m["lr_scheduler"], extra) == {"last_batch_iteration": 4}
    client = join_state(m["client_state"], extra)
    assert client.keys() == {"epoch", "pos", "t"} and client["epoch"] == 3 and client["pos"] == (1, 2)
    assert torch.equal(client["t"], torch.arange(4.0))
    assert m["topology"] == {"world_size": world, "dp_world_size": world, "zero_stage": stage}
    assert not any(p.suffix == ".pt" for p in folder.iterdir())  # nothing pickled in the native copy


def _ds(tmp_path, stage=2, world=3, **kw):
    return ds_layout.write(tmp_path / "ds", ds_layout.make_source(1), stage=stage, world=world, **kw)


def test_missing_rank_files_are_named(tmp_path):
    folder = _ds(tmp_path)
    (folder / "zero_pp_rank_2_mp_rank_00_optim_states.pt").unlink()
    with pytest.raises(FileNotFoundError, match="3 data-parallel ranks but rank 2's optimizer file"):
        convert_deepspeed_checkpoint(tmp_path / "ds", tmp_path / "out")
    folder = ds_layout.write(tmp_path / "ds3", ds_layout.make_source(1), stage=3, world=2)
    (folder / "zero_pp_rank_1_mp_rank_00_model_states.pt").unlink()
    with pytest.raises(FileNotFoundError, match="rank 1's zero_pp_rank_1_mp_rank_00_model_states.pt is missing"):
        convert_deepspeed_checkpoint(tmp_path / "ds3", tmp_path / "out3")


def test_tensor_parallel_checkpoints_are_refused(tmp_path):
    import shutil

    folder = _ds(tmp_path)
    shutil.copy(folder / "mp_rank_00_model_states.pt", folder / "mp_rank_01_model_states.pt")
    with pytest.raises(ValueError, match=r"tensor-parallel model-states files for mp ranks \[0, 1\]"):
        convert_deepspeed_checkpoint(tmp_path / "ds", tmp_path / "out")


def test_pipeline_checkpoint_problems_name_the_file(tmp_path):
    import shutil

    def damaged(edit):
        folder = tmp_path / "ds" / "global_step3"
        shutil.rmtree(tmp_path / "ds", ignore_errors=True)
        shutil.copytree(FIXTURES / "pipeline_zero1", tmp_path / "ds")
        edit(folder)
        return tmp_path / "ds"

    cases = [  # (edit, error, message)
        (lambda f: (f / "layer_02-model_states.pt").unlink(), FileNotFoundError,
         r"parameter 2\.weight of stage 0 \(mp_rank_00_model_states\.pt\): its layer file "
         r"layer_02-model_states\.pt is missing"),
        (lambda f: torch.save({"bias": torch.zeros(3)}, f / "layer_04-model_states.pt"), FileNotFoundError,
         r"parameter 4\.weight of stage 1 \(mp_rank_01_model_states\.pt\): layer_04-model_states\.pt holds no "
         r"'weight'"),
        (lambda f: (f / "layer_04-model_states.pt").write_bytes(b"not a pickle"), ValueError,
         r"layer_04-model_states\.pt: not a readable torch checkpoint file"),
        (lambda f: (f / "mp_rank_01_model_states.pt").unlink(), FileNotFoundError,
         r"saved by 2 stages but mp_rank_01_model_states\.pt \(one per stage\) missing"),
        (lambda f: (f / "zero_pp_rank_0_mp_rank_01_optim_states.pt").unlink(), FileNotFoundError,
         r"rank 0's optimizer file zero_pp_rank_0_mp_rank_01_optim_states\.pt"),
        (lambda f: shutil.copy(f / "layer_00-model_states.pt", f / "layer_00-model_01-model_states.pt"), ValueError,
         r"tensor-parallel layer slices \(layer_\*-model_<rank>-model_states\.pt for model ranks \[0, 1\]\)"),
    ]
    for edit, error, message in cases:
        with pytest.raises(error, match=message):
            convert_deepspeed_checkpoint(damaged(edit), tmp_path / "out")
    with pytest.raises(ValueError, match=r"into a model with tied layers \(tied_modules\.emb\.weight\), but no "
                                         r"stage of this DeepSpeed pipeline checkpoint names a tied module"):
        convert_deepspeed_checkpoint(FIXTURES / "pipeline_zero1", tmp_path / "out",
                                     param_names=["0.weight", "tied_modules.emb.weight"])
    # tied modules are found by their names and shapes in a layer file; without it, the tie key is named
    shutil.rmtree(tmp_path / "ds")
    shutil.copytree(FIXTURES / "pipeline_tied", tmp_path / "ds")
    (tmp_path / "ds" / "global_step3" / "layer_00-model_states.pt").unlink()
    with pytest.raises(FileNotFoundError, match=r"no layer file holds the weights of tied module\(s\) io"):
        convert_deepspeed_checkpoint(tmp_path / "ds", tmp_path / "out")
    # ZeRO-0: the optimizer names no parameters; without layer 0's file the matching cannot hold
    shutil.rmtree(tmp_path / "ds")
    shutil.copytree(FIXTURES / "pipeline_zero0", tmp_path / "ds")
    (tmp_path / "ds" / "global_step3" / "layer_00-model_states.pt").unlink()
    with pytest.raises(DeepSpeedLayoutError, match=r"mp_rank_00_model_states\.pt field 'optimizer'.*stage 0; the layer "
                                                   r"files with weights are those of layers \[2, 4\]"):
        convert_deepspeed_checkpoint(tmp_path / "ds", tmp_path / "out")


def test_layout_differences_name_the_field(tmp_path):
    def drop(rank, osd):
        del osd["single_partition_of_fp32_groups"]

    _ds(tmp_path, edit_optim=drop)
    with pytest.raises(DeepSpeedLayoutError, match="field 'single_partition_of_fp32_groups' missing"):
        convert_deepspeed_checkpoint(tmp_path / "ds", tmp_path / "out")

    def shift(rank, osd):  # another DeepSpeed placing the parameters differently in the partition
        for mapping in osd["param_slice_mappings"]:
            for addr in mapping.values():
                addr.start += 1

    ds_layout.write(tmp_path / "ds2", ds_layout.make_source(1), stage=1, world=2, edit_optim=shift)
    with pytest.raises(DeepSpeedLayoutError, match="field 'param_slice_mappings' of group 0 does not match"):
        convert_deepspeed_checkpoint(tmp_path / "ds2", tmp_path / "out2")

    def short(rank, osd):
        osd["fp32_flat_groups"] = [g[:-1] for g in osd["fp32_flat_groups"]]

    ds_layout.write(tmp_path / "ds3", ds_layout.make_source(1), stage=3, world=2, edit_optim=short)
    with pytest.raises(DeepSpeedLayoutError, match="field 'fp32_flat_groups' holds"):
        convert_deepspeed_checkpoint(tmp_path / "ds3", tmp_path / "out3")


def test_zero0_names_come_from_the_model_when_the_counts_differ(tmp_path):
    ds_layout.write(tmp_path / "ds", ds_layout.make_source(1), stage=0, world=1)
    # without the model, the frozen parameter makes the in-order matching ambiguous: refused, not guessed
    with pytest.raises(DeepSpeedLayoutError, match="the optimizer holds 5 parameters, the module 6"):
        convert_deepspeed_checkpoint(tmp_path / "ds", tmp_path / "out")


def test_a_pickle_naming_os_system_is_refused_without_running_it(tmp_path):
    marker = tmp_path / "pwned"
    folder = _ds(tmp_path, world=2)
    target = folder / "zero_pp_rank_1_mp_rank_00_optim_states.pt"

    class Evil:
        def __reduce__(self):
            import os

            return (os.system, (f"touch {marker}",))

    torch.save({"optimizer_state_dict": {"loss_scaler": Evil()}}, target)  # torch's zip format
    with pytest.raises(RefusedPickle, match=r"refused to unpickle global '(posix|os)\.system'"):
        convert_deepspeed_checkpoint(tmp_path / "ds", tmp_path / "out")
    # a bare protocol-0 pickle: GLOBAL 'os system', then a call
    target.write_bytes(b"cos\nsystem\n(S'touch " + str(marker).encode() + b"'\ntR.")
    with pytest.raises(RefusedPickle, match=r"refused to unpickle global 'os\.system'"):
        convert_deepspeed_checkpoint(tmp_path / "ds", tmp_path / "out")
    # any other global too, e.g. a class DeepSpeed does not write
    torch.save({"optimizer_state_dict": {"x": __import__("fractions").Fraction(1, 3)}}, target)
    with pytest.raises(RefusedPickle, match=r"'fractions\.Fraction'"):
        convert_deepspeed_checkpoint(tmp_path / "ds", tmp_path / "out")
    assert not marker.exists()


def test_cli_convert_and_consolidate_read_deepspeed_folders(tmp_path, capsys):
    from shardwise.checkpoint.consolidate import get_fp32_state_dict_from_checkpoint
    from shardwise.checkpoint.deepspeed_format import is_deepspeed_checkpoint
    from shardwise.cli import main

    assert main(["convert", "--from-deepspeed", str(FIXTURES / "zero3"), str(tmp_path / "native")]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "native" / "global_step3")
    native = get_fp32_state_dict_from_checkpoint(tmp_path / "native")
    assert is_deepspeed_checkpoint(FIXTURES / "zero2") and is_deepspeed_checkpoint(FIXTURES / "zero3" / "global_step3")
    assert not is_deepspeed_checkpoint(tmp_path / "native")  # the converted copy loads as a native checkpoint
    assert not is_deepspeed_checkpoint(tmp_path / "native" / "global_step3")
    assert main(["consolidate", str(FIXTURES / "zero2"), str(tmp_path / "hf")]) == 0
    from safetensors.torch import load_file

    merged = {}
    for f in sorted((tmp_path / "hf").glob("model-*.safetensors")):
        merged.update(load_file(f))
    assert merged.keys() == native.keys() == {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias", "frozen", "shift"}
    # ZeRO-2 and ZeRO-3 runs of the same seed and data saved the same weights (DeepSpeed's own runs)
    for k in native:
        assert torch.equal(native[k], merged[k]), k
    with pytest.raises(SystemExit):
        main(["convert", "--from-deepspeed", str(tmp_path / "nothing"), str(tmp_path / "x")])
    assert "no DeepSpeed checkpoint there" in capsys.readouterr().err
