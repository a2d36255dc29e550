"""DeepSpeed's API surface under ``import shardwise as deepspeed``: module paths, names and
signatures (checked against DeepSpeed 0.19's, listed here), the accelerator, the scheduler
example, elasticity, unsupported paths and the launcher flags of ``deepspeed``.

The multi-process scripts (ZeRO-3 client script, DS-Chat step-1 loop, zero_to_fp32.py in a fresh
venv) are in tests/test_deepspeed_scripts.py.
"""
from __future__ import annotations

import importlib
import inspect
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]

# (module path, attribute, DeepSpeed 0.19.8's parameter names in order). Read off
# deepspeed/<module>.py; "self" left out for methods.
SIGNATURES = [
    ("shardwise", "initialize", ["args", "model", "optimizer", "model_parameters", "training_data", "lr_scheduler",
                                 "mpu", "dist_init_required", "collate_fn", "config", "config_params"]),
    ("shardwise", "init_distributed", ["dist_backend", "auto_mpi_discovery", "distributed_port", "verbose", "timeout",
                                       "init_method", "dist_init_required", "config", "rank", "world_size"]),
    ("shardwise.utils", "log_dist", ["message", "ranks", "level"]),
    ("shardwise.utils", "set_z3_leaf_modules", ["model", "leaf_module_classes", "raise_if_not_found"]),
    ("shardwise.utils", "unset_z3_leaf_modules", ["model", "leaf_module_classes", "raise_if_not_found"]),
    ("shardwise.utils", "get_z3_leaf_modules", ["model"]),
    ("shardwise.utils", "safe_get_full_fp32_param", ["param"]),
    ("shardwise.utils", "safe_get_full_grad", ["param"]),
    ("shardwise.utils", "safe_get_full_optimizer_state", ["param", "optim_state_key"]),
    ("shardwise.utils", "safe_set_full_fp32_param", ["param", "value"]),
    ("shardwise.utils", "safe_set_full_optimizer_state", ["param", "value", "optim_state_key"]),
    ("shardwise.utils.zero_to_fp32", "get_fp32_state_dict_from_zero_checkpoint",
     ["checkpoint_dir", "tag", "exclude_frozen_parameters", "lazy_mode"]),
    ("shardwise.utils.zero_to_fp32", "convert_zero_checkpoint_to_fp32_state_dict",
     ["checkpoint_dir", "output_dir", "max_shard_size", "safe_serialization", "tag", "exclude_frozen_parameters"]),
    ("shardwise.utils.zero_to_fp32", "load_state_dict_from_zero_checkpoint", ["model", "checkpoint_dir", "tag"]),
    ("shardwise.runtime.utils", "see_memory_usage", ["message", "force"]),
    ("shardwise.runtime.utils", "set_random_seed", ["seed"]),
    ("shardwise.comm", "all_gather", ["tensor_list", "tensor", "group", "async_op", "prof", "log_name", "debug"]),
    ("shardwise.comm", "all_gather_into_tensor", ["output_tensor", "tensor", "group", "async_op"]),
    ("shardwise.comm", "reduce_scatter_tensor", ["output_tensor", "tensor", "op", "group", "async_op"]),
    ("shardwise.comm", "send", ["tensor", "dst", "group", "tag", "prof", "log_name", "debug"]),
    ("shardwise.comm", "recv", ["tensor", "src", "group", "tag", "prof", "log_name", "debug"]),
    ("shardwise.comm", "isend", ["tensor", "dst", "group", "tag", "prof", "log_name", "debug"]),
    ("shardwise.comm", "irecv", ["tensor", "src", "group", "tag", "prof", "log_name", "debug"]),
    ("shardwise.comm", "all_to_all_single", ["output", "tensor", "output_split_sizes", "input_split_sizes", "group",
                                             "async_op", "prof", "log_name", "debug"]),
    ("shardwise.comm", "get_world_group", []),
    ("shardwise.comm", "get_local_rank", []),
    ("shardwise.comm", "get_global_rank", ["group", "group_rank"]),
    ("shardwise.comm", "new_group", ["ranks"]),
    ("shardwise.comm", "barrier", ["group", "async_op", "device_ids"]),
    ("shardwise.elasticity", "compute_elastic_config", ["ds_config", "target_deepspeed_version", "world_size",
                                                        "return_microbatch"]),
    ("shardwise.zero", "GatheredParameters", ["params", "modifier_rank", "fwd_module", "enabled"]),
]

ENGINE_METHODS = [
    ("zero_optimization_stage", []), ("zero_optimization", []), ("fp16_enabled", []), ("bfloat16_enabled", []),
    ("zero_offload_optimizer", []), ("zero_cpu_offload", []), ("gradient_clipping", []),
    ("set_gradient_accumulation_boundary", ["is_boundary"]), ("was_step_applied", []), ("optimizer_name", []),
    ("allreduce_gradients", ["bucket_size"]),
    ("set_train_batch_size", ["train_batch_size"]), ("get_data_parallel_rank", []),
    ("get_data_parallel_world_size", []), ("destroy", []), ("zero_gather_16bit_weights_on_model_save", []),
    ("offload_states", ["include", "device", "pin_memory", "non_blocking"]), ("reload_states", ["non_blocking"]),
    ("_zero3_consolidated_16bit_state_dict", ["exclude_frozen_parameters"]),
    ("save_checkpoint", ["save_dir", "tag", "client_state", "save_latest", "exclude_frozen_parameters"]),
    ("load_checkpoint", ["load_dir", "tag", "load_module_strict", "load_optimizer_states",
                         "load_lr_scheduler_states", "load_module_only", "custom_load_fn"]),
]


def _params(fn) -> list[str]:
    return [n for n in inspect.signature(fn).parameters if n != "self"]


@pytest.mark.parametrize("module,name,expected", SIGNATURES, ids=[f"{m}.{n}" for m, n, _ in SIGNATURES])
def test_signature_matches_deepspeed(module, name, expected):
    obj = getattr(importlib.import_module(module), name)
    names = _params(obj)
    # DeepSpeed's parameters come first and in its order; shardwise may accept more after them.
    assert names[: len(expected)] == expected, f"{module}.{name}{inspect.signature(obj)}"


def test_engine_methods_match_deepspeed():
    from shardwise.runtime.engine import DeepSpeedEngine

    bad = {m: _params(getattr(DeepSpeedEngine, m)) for m, want in ENGINE_METHODS
           if _params(getattr(DeepSpeedEngine, m))[: len(want)] != want}
    assert not bad
    import shardwise

    assert shardwise.DeepSpeedEngine is DeepSpeedEngine
    assert inspect.signature(DeepSpeedEngine.save_checkpoint).parameters["tag"].default is None


def test_module_paths_resolve():
    """The paths DeepSpeed scripts import, all present."""
    import shardwise as deepspeed
    from shardwise import get_accelerator, log_dist, logger  # noqa: F401
    from shardwise.accelerator import get_accelerator as ga
    from shardwise.comm import get_world_group  # noqa: F401
    from shardwise.runtime.engine import DeepSpeedEngine  # noqa: F401
    from shardwise.optim.lr_schedules import WarmupLR  # noqa: F401
    from shardwise.runtime.utils import see_memory_usage, set_random_seed  # noqa: F401
    from shardwise.zero import GatheredParameters  # noqa: F401
    from shardwise.utils import RepeatingLoader, log_dist as ld, logger as lg  # noqa: F401
    from shardwise.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint  # noqa: F401

    with deepspeed.OnDevice(dtype=torch.bfloat16, device="meta"):
        layer = torch.nn.Linear(3, 4)
    assert layer.weight.device.type == "meta" and layer.weight.dtype == torch.bfloat16
    assert torch.get_default_dtype() == torch.float32
    assert ga is get_accelerator and ld is log_dist and lg is logger
    assert deepspeed.utils.RepeatingLoader is deepspeed.RepeatingLoader
    assert isinstance(logger, logging.Logger) and logger.name == "shardwise"
    # the pipeline: DeepSpeed's deepspeed.runtime.pipe.* paths are the compat package's (test below)
    from shardwise.pipe import LayerSpec, PipelineModule  # noqa: F401
    from shardwise.pipe.engine import PipelineEngine

    assert PipelineEngine is deepspeed.PipelineEngine and PipelineModule is deepspeed.pipe.PipelineModule
    assert issubclass(PipelineEngine, DeepSpeedEngine)
    from shardwise.runtime.hybrid_engine import DeepSpeedHybridEngine

    assert DeepSpeedHybridEngine is deepspeed.DeepSpeedHybridEngine and issubclass(DeepSpeedHybridEngine, DeepSpeedEngine)


def test_unsupported_paths_say_so():
    with pytest.raises(ModuleNotFoundError, match=r"deepspeed\.runtime\.domino\) is not supported"):
        importlib.import_module("shardwise.runtime.domino")
    with pytest.raises(ImportError, match="deepspeed.inference.* not supported"):
        exec("from shardwise.inference.quantization import quantization", {})
    with pytest.raises(ImportError, match=r"deepspeed\.inference\.v2\) is not supported"):
        importlib.import_module("shardwise.inference.v2")
    with pytest.raises(AttributeError, match=r"deepspeed\.replace_transformer_layer\) is not supported"):
        import shardwise

        shardwise.replace_transformer_layer  # noqa: B018
    with pytest.raises(AttributeError, match="has no attribute 'no_such_thing'"):
        shardwise.no_such_thing  # noqa: B018
    # a real module is never shadowed by the table
    assert importlib.import_module("shardwise.zero.init").GatheredParameters


def test_accelerator_on_cpu(monkeypatch):
    from shardwise.accelerator import real_accelerator

    monkeypatch.setattr(real_accelerator, "_current", [None])
    monkeypatch.setenv("LOCAL_RANK", "1")
    acc = real_accelerator.get_accelerator()
    assert acc.device_name() == "cpu" and acc.device_name(0) == "cpu" and acc.current_device_name() == "cpu"
    assert acc.current_device() == 1  # DeepSpeed's CPU accelerator answers LOCAL_RANK
    assert acc.communication_backend_name() == "gloo"
    assert acc.is_bf16_supported() is True and isinstance(acc.is_fp16_supported(), bool)
    acc.set_device(0)
    acc.synchronize()
    acc.empty_cache()
    acc.manual_seed(3)
    a = torch.rand(3)
    acc.manual_seed(3)
    assert torch.equal(a, torch.rand(3))
    before = acc.memory_allocated()
    big = torch.ones(64 * 1024 * 1024 // 4)  # 64 MiB resident
    big.add_(1)
    assert acc.memory_allocated() > before and acc.max_memory_allocated() >= acc.memory_allocated()
    del big
    t = torch.zeros(2)
    assert acc.pin_memory(t) is t and acc.on_accelerator(t)
    assert acc.Stream is None and acc.Event is None  # DeepSpeed's CPU accelerator has neither
    assert acc.device_count() >= 1


def _seed_scheduler_example(caplog):
    """A scheduler example: a client optim.Adam, a config 'optimizer' block and WarmupLR."""
    import shardwise as deepspeed

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 2)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    config = {
        "train_batch_size": 4,
        "optimizer": {"type": "Adam", "params": {"lr": 0.01}},
        "scheduler": {"type": "WarmupLR",
                      "params": {"warmup_min_lr": 0.001, "warmup_max_lr": 0.01, "warmup_num_steps": 100}},
    }
    with caplog.at_level(logging.INFO, logger="shardwise"):
        engine, opt, _, sched = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    x = torch.randn(4, 8)
    lrs = []
    for _ in range(2):
        engine.backward(engine(x).pow(2).mean())
        engine.step()
        lrs.append(engine.get_lr()[0])
    return engine, opt, optimizer, lrs


def test_seed_scheduler_example_client_optimizer_wins(caplog):
    engine, opt, client, lrs = _seed_scheduler_example(caplog)
    assert opt is client and engine.optimizer_name() == "Adam"
    # DeepSpeed 0.19.8 prints the same two numbers for this script (run under DS_ACCELERATOR=cpu):
    # the first step leaves WarmupLR at warmup_min_lr (log(1) = 0), the next one is log(2)/log(100) in.
    assert lrs == [0.001, 0.0023546349804879152]
    won = [r for r in caplog.records if "client optimizer" in r.getMessage()]
    assert len(won) == 1 and "'optimizer' block (type Adam) is not used" in won[0].getMessage()


# -------------------------------------------------------------------------- elasticity

DS_ELASTIC = {"elasticity": {"enabled": True, "max_train_batch_size": 10000, "micro_batch_sizes": [8, 12, 16, 17],
                             "min_gpus": 32, "max_gpus": 1500, "min_time": 20, "version": 0.1}}


def test_compute_elastic_config_matches_deepspeed_numbers():
    """The numbers DeepSpeed's own elasticity tests assert (tests/unit/elasticity/test_elastic.py)."""
    from shardwise.elasticity import (ElasticityConfigError, ElasticityError, ElasticityIncompatibleWorldSize,
                                      compute_elastic_config)

    batch, valid = compute_elastic_config(DS_ELASTIC, "0.19.8")
    assert (batch, len(valid)) == (9792, 23)
    assert all(batch % g == 0 and any(batch // g % m == 0 for m in (8, 12, 16, 17)) for g in valid)
    assert compute_elastic_config(DS_ELASTIC, "0.19.8", world_size=64)[2] == 17
    small = {"elasticity": dict(DS_ELASTIC["elasticity"], max_train_batch_size=32, micro_batch_sizes=[1, 2, 3, 7],
                                min_gpus=1)}
    assert compute_elastic_config(small, "0.19.8", world_size=7)[2] == 3
    with pytest.raises(ElasticityIncompatibleWorldSize):
        compute_elastic_config(DS_ELASTIC, "0.19.8", world_size=128)
    with pytest.raises(ElasticityError):
        compute_elastic_config(DS_ELASTIC, "0.2")  # older than elasticity itself
    with pytest.raises(ElasticityConfigError, match="disabled"):
        compute_elastic_config({"elasticity": {"enabled": False}}, "0.19.8")
    with pytest.raises(ElasticityConfigError, match="max_train_batch_size is required"):
        compute_elastic_config({"elasticity": {"enabled": True}}, "0.19.8")
    with pytest.raises(ElasticityConfigError, match="micro_batch_sizes"):
        compute_elastic_config({"elasticity": dict(DS_ELASTIC["elasticity"], micro_batch_sizes=[2, 0.5])}, "0.19.8")
    v2 = {"elasticity": dict(DS_ELASTIC["elasticity"], version=0.2, model_parallel_size=4, num_gpus_per_node=8)}
    with pytest.raises(ElasticityConfigError, match="model parallelism"):
        compute_elastic_config({"elasticity": dict(v2["elasticity"], version=0.1)}, "0.19.8")
    os.environ["WORLD_SIZE"] = "16"  # version 0.2 reads the GPU count from there, as in DeepSpeed
    try:
        batch2, valid2 = compute_elastic_config(v2, "0.19.8")
    finally:
        del os.environ["WORLD_SIZE"]
    assert 0 < batch2 <= 10000 and all(g % 2 == 0 for g in valid2)  # 8 GPUs per node / mp 4 = 2 dp ranks


def test_elasticity_block_sets_the_batch_triad():
    import shardwise
    from shardwise.elasticity import ElasticityConfigError, compute_elastic_config

    block = {"enabled": True, "max_train_batch_size": 32, "micro_batch_sizes": [2, 4], "min_gpus": 1, "max_gpus": 4,
             "version": 0.1}
    cfg = {"optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "elasticity": block}
    engine, *_ = shardwise.initialize(model=torch.nn.Linear(4, 2), config=cfg)
    batch, _, micro = compute_elastic_config({"elasticity": block}, "0.19.8", world_size=1)
    assert (engine.train_batch_size(), engine.train_micro_batch_size_per_gpu(),
            engine.gradient_accumulation_steps()) == (batch, micro, batch // micro)
    with pytest.raises(ElasticityConfigError, match="train_batch_size set next to an enabled 'elasticity'"):
        shardwise.initialize(model=torch.nn.Linear(4, 2), config=dict(cfg, train_batch_size=8))
    engine, *_ = shardwise.initialize(model=torch.nn.Linear(4, 2), config=dict(
        cfg, train_batch_size=8, elasticity=dict(block, ignore_non_elastic_batch_info=True)))
    assert engine.train_batch_size() == batch


# ---------------------------------------------------------------------------- launcher

# Every flag of DeepSpeed 0.19.8's `deepspeed` runner (deepspeed/launcher/runner.py: parse_args).
DS_RUNNER_FLAGS = [
    ["-H", "hf"], ["--hostfile", "hf"], ["-i", "localhost:0"], ["--include", "localhost:0"], ["-e", "h:1"],
    ["--exclude", "h:1"], ["--num_nodes", "1"], ["--num_gpus", "2"], ["--num_accelerators", "2"],
    ["--master_port", "29512"], ["--master_addr", "127.0.0.1"], ["--node_rank", "0"], ["--launcher", "pdsh"],
    ["--launcher", "openmpi"], ["--launcher", "mpich"], ["--launcher", "impi"], ["--launcher", "mvapich"],
    ["--launcher", "slurm"], ["--launcher_args", "-x FOO"], ["--module"], ["--no_python"], ["--no_local_rank"],
    ["--no_ssh"], ["--no_ssh_check"], ["--force_multi"], ["--save_pid"], ["--enable_each_rank_log", "logs"],
    ["--autotuning", "tune"], ["--autotuning", "run"], ["--bind_cores_to_rank"], ["--bind_core_list", "0,2-3"],
    ["--ssh_port", "22"], ["--venv_script", "venv.sh"], ["--log_level", "warning"], ["-q"], ["--quiet"],
]


@pytest.mark.parametrize("flags", DS_RUNNER_FLAGS, ids=[" ".join(f) for f in DS_RUNNER_FLAGS])
def test_shardwise_run_accepts_every_deepspeed_flag(flags):
    from shardwise.cli import build_parser
    from shardwise.launcher.options import options_from_args

    ns = build_parser().parse_args(["run", *flags, "train.py", "--deepspeed"])
    opts = options_from_args(ns)
    assert opts.script == "train.py" and opts.script_args == ["--deepspeed"]
    if flags[0] == "--launcher":
        assert opts.launcher == ("mpi" if flags[1] in ("openmpi", "mpich", "impi", "mvapich") else flags[1])
    if flags[0] == "--no_ssh_check":
        assert opts.skip_doctor
    if flags[0] == "--bind_core_list":
        assert opts.bind_cores_to_rank and opts.bind_core_list == "0,2-3"
    if flags[0] == "--num_accelerators":
        assert opts.num_procs == 2


def test_no_deepspeed_console_script():
    text = (REPO / "pyproject.toml").read_text()
    scripts = text.split("[project.scripts]", 1)[1].split("\n[", 1)[0]
    assert "deepspeed" not in scripts and "shardwise =" in scripts


def test_core_list_and_bad_values():
    from shardwise.launcher.ds_flags import parse_core_list
    from shardwise.launcher.options import LaunchOptions, validate

    assert parse_core_list("0,2-4,7") == [0, 2, 3, 4, 7]
    with pytest.raises(ValueError, match="--bind_core_list"):
        parse_core_list("0,x")
    with pytest.raises(ValueError, match="--venv_script 'nope.sh': no such file"):
        validate(LaunchOptions(script=__file__, venv_script="nope.sh"))


ELASTIC_SCRIPT = """
import json, os, sys, torch
import shardwise as deepspeed
block = {"enabled": True, "max_train_batch_size": 24, "micro_batch_sizes": [2, 3], "min_gpus": 1,
         "max_gpus": 4, "version": 0.1}
engine, *_ = deepspeed.initialize(model=torch.nn.Linear(4, 2), config={
    "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "elasticity": block})
print("VENV", os.environ.get("VENV_MARK"))
print("TRIAD", json.dumps([engine.train_batch_size(), engine.train_micro_batch_size_per_gpu(),
                            engine.gradient_accumulation_steps(), engine.dp_world_size]))
"""


def test_run_elastic_with_each_rank_log_and_venv_script(tmp_path):
    """`shardwise run --elastic` with an elasticity config: every rank trains on the batch size
    compute_elastic_config gives for the world it got; --enable_each_rank_log puts each rank's
    output in its own file; --venv_script is sourced first."""
    from shardwise.elasticity import compute_elastic_config

    script = tmp_path / "train.py"
    script.write_text(ELASTIC_SCRIPT)
    venv = tmp_path / "activate"
    venv.write_text("export VENV_MARK=sourced\n")
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env["PYTHONPATH"] = str(REPO)
    logs = tmp_path / "logs"
    proc = subprocess.run([sys.executable, "-m", "shardwise", "run", "--num_accelerators", "2", "--elastic", "1:1",
                           "--master_port", str(_free_port()), "--enable_each_rank_log", str(logs),
                           "--venv_script", str(venv), "--no_ssh_check", "--log_level", "warning", str(script)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    files = sorted(logs.glob("*_rank*.log"))
    assert [f.name.rsplit("_", 1)[1] for f in files] == ["rank0.log", "rank1.log"]
    assert "TRIAD" not in proc.stdout  # the ranks' output went to the files
    block = {"enabled": True, "max_train_batch_size": 24, "micro_batch_sizes": [2, 3], "min_gpus": 1, "max_gpus": 4,
             "version": 0.1}
    batch, _, micro = compute_elastic_config({"elasticity": block}, "0.19.8", world_size=2)
    for f in files:
        text = f.read_text()
        assert "VENV sourced" in text, text
        triad = json.loads(text.split("TRIAD", 1)[1].splitlines()[0])
        assert triad == [batch, micro, batch // (micro * 2), 2], text


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_node_agents_get_the_deepspeed_flags():
    from shardwise.launcher.options import LaunchOptions
    from shardwise.launcher.runners import agent_command

    opts = LaunchOptions(script="train.py", enable_each_rank_log="/logs", bind_core_list="0-3",
                         venv_script="/env/bin/activate")
    cmd = agent_command(opts, {"a": [0], "b": [0]}, master_addr="a", master_port=29500, local_addr=None)
    joined = " ".join(cmd)
    assert "--enable_each_rank_log /logs" in joined and "--bind_core_list 0-3" in joined
    assert "--venv_script /env/bin/activate" in joined and cmd[-1] == "train.py"


def test_autotuning_flag_hands_over_to_autotune(tmp_path, monkeypatch):
    """--autotuning tune runs `shardwise autotune` only; run then launches with the best config."""
    import shardwise.autotuning
    import shardwise.launcher
    from shardwise.cli import main

    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"train_batch_size": 4, "autotuning": {"enabled": True,
                                                                     "results_dir": str(tmp_path / "res")}}))
    script = tmp_path / "train.py"
    script.write_text("")
    tuned, launched = [], []
    monkeypatch.setattr(shardwise.autotuning, "run", lambda ns: tuned.append(list(ns.script_args)) or 0)
    monkeypatch.setattr(shardwise.launcher, "run", lambda opts: launched.append(opts) or 0)
    assert main(["run", "--autotuning", "tune", str(script), "--deepspeed_config", str(cfg)]) == 0
    assert tuned == [["--deepspeed_config", str(cfg)]] and launched == []
    assert main(["run", "--autotuning", "run", str(script), f"--deepspeed_config={cfg}"]) == 0
    best = str(tmp_path / "res" / "ds_config_optimal.json")
    assert [o.script_args for o in launched] == [[f"--deepspeed_config={best}"]]


_ZERO_LINEAR_PROBE = r"""
# DeepSpeed's ZeRO-3 linear: nn.Linear's values and gradients (1-3 dim inputs, with and without bias, fp32 and under
# autocast), saving for backward only the tensors it was given (no lower-precision copies), autocast off stays fp32
import functools, os, tempfile
import deepspeed.runtime.zero.linear as zl
assert zl.autocast_custom_fwd.func is torch.amp.custom_fwd and zl.autocast_custom_fwd.keywords == {"device_type": "cpu"}
torch.manual_seed(0)
for shape, bias, cast in [(s, b, c) for s in [(5,), (3, 5), (2, 3, 5)] for b in (True, False) for c in (False, True)]:
    ref = torch.nn.Linear(5, 4, bias=bias)
    mine = zl.LinearModuleForZeroStage3(5, 4, bias=bias)
    mine.load_state_dict(ref.state_dict())
    x = torch.randn(*shape, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    saved = []
    with torch.autocast("cpu", enabled=cast):
        a = ref(x)
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            b = mine(x2)
    assert b.dtype == a.dtype == (torch.bfloat16 if cast else torch.float32)
    given = {x2.data_ptr(), mine.weight.data_ptr()} | ({mine.bias.data_ptr()} if bias else set())
    assert {t.data_ptr() for t in saved if t is not None} <= given and all(t.dtype == torch.float32 for t in saved if t is not None)
    g = torch.randn_like(a)
    a.backward(g); b.backward(g)
    pairs = [(b, a), (x2.grad, x.grad), (mine.weight.grad, ref.weight.grad)] + ([(mine.bias.grad, ref.bias.grad)] if bias else [])
    for m, r in pairs:
        assert m.dtype == r.dtype and torch.equal(m, r), (shape, bias, cast)
with torch.autocast("cpu", enabled=False):
    assert zl.zero3_linear_wrap(torch.randn(2, 5), mine.weight).dtype == torch.float32
# zero_to_fp32.get_optim_files: DeepSpeed's *_optim_states.pt files of a folder, numbers in order
from deepspeed.utils.zero_to_fp32 import get_optim_files, get_fp32_state_dict_from_zero_checkpoint
folder = tempfile.mkdtemp()
names = [f"zero_pp_rank_{i}_mp_rank_00_optim_states.pt" for i in (0, 1, 2, 10)] + ["mp_rank_00_model_states.pt"]
for n in names:
    open(os.path.join(folder, n), "w").close()
assert get_optim_files(folder) == [os.path.join(folder, n) for n in names[:4]]
with pytest.raises(FileNotFoundError, match="_optim_states.pt"):
    get_optim_files(tempfile.mkdtemp())
"""


_COMPAT_PROBE = r"""
import sys, warnings
import pytest, torch
import deepspeed, shardwise
assert deepspeed.__file__.startswith(sys.argv[1]), deepspeed.__file__
# DeepSpeed's paths that only re-export shardwise modules live in the compat package
from deepspeed.runtime.pipe import LayerSpec, PipelineModule, ProcessTopology
from deepspeed.runtime.pipe.engine import PipelineEngine
from deepspeed.runtime.pipe.schedule import TrainSchedule
from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology, _prime_factors
from deepspeed.runtime.activation_checkpointing import checkpointing
from deepspeed.runtime import lr_schedules as lrs
from deepspeed.runtime.zero.partition_parameters import GatheredParameters, MultipleAllGatherHandles
from deepspeed.runtime.zero import unwrap_model_for_generation
from shardwise.zero.param_offload import gathered_for_generation
assert unwrap_model_for_generation is gathered_for_generation
from deepspeed.module_inject.layers import LinearLayer
assert PipelineModule is shardwise.pipe.PipelineModule and PipelineEngine.__bases__[1] is shardwise.pipe.engine.PipelineEngine
assert TrainSchedule is shardwise.pipe.schedule.TrainSchedule and issubclass(GatheredParameters, shardwise.zero.GatheredParameters)
assert checkpointing is shardwise.checkpointing and deepspeed.runtime.engine.DeepSpeedEngine.__bases__[1] is shardwise.runtime.engine.Engine
assert lrs.WarmupLR is shardwise.optim.lr_schedules.WarmupLR and lrs.WARMUP_MIN_LR == "warmup_min_lr"
assert [getattr(lrs, n).__name__ for n in lrs.VALID_LR_SCHEDULES] == lrs.VALID_LR_SCHEDULES
assert _prime_factors(12) == [2, 2, 3] and _prime_factors(13) == [13]
with pytest.raises(ValueError):
    _prime_factors(0)
# the ZeRO block under DeepSpeed's class and field names, validated by shardwise's model
from deepspeed.runtime.zero.config import DeepSpeedZeroConfig, DeepSpeedZeroOffloadOptimizerConfig
with warnings.catch_warnings():
    warnings.simplefilter("ignore", FutureWarning)
    cfg = DeepSpeedZeroConfig(stage=3, stage3_prefetch_bucket_size=7, cpu_offload=True)
assert cfg.prefetch_bucket_size == 7 and cfg.overlap_comm is True
assert isinstance(cfg.offload_optimizer, DeepSpeedZeroOffloadOptimizerConfig) and cfg.offload_optimizer.device == "cpu"
assert DeepSpeedZeroOffloadOptimizerConfig(pipeline_write=True).pipeline
with pytest.raises(ValueError, match="no_such_key"):
    DeepSpeedZeroConfig(no_such_key=1)
# names of what shardwise does not have: importable, refusing with the reason when used
from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
with pytest.raises(NotImplementedError, match="bf16"):
    BF16_Optimizer()
# deepspeed.moe.* are shardwise.moe's modules
import deepspeed.moe.experts, deepspeed.moe.sharded_moe, deepspeed.moe.utils
from deepspeed.moe.layer import MoE
from deepspeed.utils import groups as ds_groups
assert MoE is sys.modules["shardwise.moe.layer"].MoE and deepspeed.moe.utils.is_moe_param
assert ds_groups.__name__ == "deepspeed.utils.groups" and "shardwise.utils.groups" not in sys.modules
# views of the active grid: with none, tensor size 1, sequence parallelism off, no expert groups yet
assert ds_groups.get_tensor_model_parallel_world_size() == 1 and ds_groups._get_sequence_parallel_world_size() == 1
assert ds_groups._get_expert_parallel_group_dict() == {} and ds_groups._get_max_expert_size() == 1
with pytest.raises(KeyError, match="ep_size_2"):
    ds_groups._get_expert_parallel_group("ep_size_2")
assert ds_groups._get_expert_parallel_ranks(16, 2, 4)[0] == [[0, 2, 4, 6], [8, 10, 12, 14], [1, 3, 5, 7], [9, 11, 13, 15]]
# DeepSpeed's sequence-parallel mpu: compat views of the grid shardwise lays out; DeepSpeed's register_with_transformers
from deepspeed.runtime.sequence_parallel import parallel_state_sp, ulysses_sp
from deepspeed.runtime.pipe.topology import PipelineParallelGrid
import shardwise.runtime.sequence_parallel.ulysses_sp as sw_ulysses
assert parallel_state_sp.__name__ == "deepspeed.runtime.sequence_parallel.parallel_state_sp" and not parallel_state_sp.is_initialized()
assert sw_ulysses.__name__ == "shardwise.runtime.sequence_parallel.ulysses_sp"  # shardwise's package left as it was
assert issubclass(ulysses_sp.UlyssesSPAttentionHF, sw_ulysses.UlyssesSPAttentionHF) and ulysses_sp.TiledMLP is sw_ulysses.TiledMLP
assert ulysses_sp.UlyssesSPAttentionHF.register_with_transformers("x", "sdpa", 1, 1) is None
assert not hasattr(shardwise.topology, "PipelineParallelGrid") and callable(PipelineParallelGrid)
import deepspeed.runtime.domino  # DeepSpeed's module tree imports whole; what shardwise lacks raises when used
with pytest.raises(NotImplementedError, match="deepspeed.runtime.domino.transformer.DominoModule is not supported"):
    deepspeed.runtime.domino.transformer.DominoModule()
with pytest.raises(ModuleNotFoundError, match="deepspeed.runtime.no_such_module"):
    import deepspeed.runtime.no_such_module
# the launcher module: hostfile and filter helpers; main() raises ValueError like DeepSpeed's
from deepspeed.launcher import runner
assert runner._parse_hostfile(["a slots=2", "", "b slots=1"]) == {"a": 2, "b": 1}
assert runner.parse_resource_filter({"a": [0, 1], "b": [0]}, exclude_str="a:1") == {"a": [0], "b": [0]}
with pytest.raises(ValueError, match="cannot be combined with --include"):
    runner.main(["--num_nodes", "1", "-i", "localhost", __file__])
from deepspeed.utils.numa import parse_range_list
assert parse_range_list("0,2-4") == [0, 2, 3, 4]
for bad in ("1,6-2", "8,2-6", "0,2-6,5-9"):  # backwards, out of order, overlapping
    with pytest.raises(ValueError):
        parse_range_list(bad)
from deepspeed.accelerator import is_current_accelerator_supported
# DeepSpeed-Chat's imports: the helpers DeepSpeed 0.19.8 kept when it removed the compression library
with pytest.warns(FutureWarning, match="deepspeed.utils.module_utils"):
    from deepspeed.compression.helper import recursive_getattr, recursive_setattr
from deepspeed.utils import module_utils
assert module_utils.recursive_getattr is recursive_getattr
net = torch.nn.Sequential(torch.nn.Sequential(torch.nn.Linear(2, 2)))
assert recursive_getattr(net, "0.0.weight") is net[0][0].weight
recursive_setattr(net, "0.0", torch.nn.Identity())
assert isinstance(net[0][0], torch.nn.Identity)
recursive_setattr(net, "extra", torch.nn.ReLU())
assert isinstance(net.extra, torch.nn.ReLU)
with pytest.raises(ImportError, match="compression library was removed"):
    import deepspeed.compression.compress
# AutoTP's split arithmetic and universal-checkpoint metadata; DeepSpeed's optimizer classes by name
from deepspeed.module_inject.tp_shard import AutoTPMeta, get_shard_size_list
assert get_shard_size_list(101, 2, AutoTPMeta(), "lm_head") == [51, 50]
assert get_shard_size_list(96, 4, AutoTPMeta(num_kv_heads=6), "q_proj") == [32, 32, 16, 16]
from deepspeed.checkpoint import UNIVERSAL_CHECKPOINT_INFO
from deepspeed.module_inject.layers import LinearAllreduce as DsRow, collect_autotp_universal_checkpoint_info
m = torch.nn.Module()
m.o = DsRow(torch.nn.Linear(4, 2), None, name="o")
m.n = torch.nn.LayerNorm(2)
info = collect_autotp_universal_checkpoint_info(m)
assert UNIVERSAL_CHECKPOINT_INFO == "universal_checkpoint_info" and info["parameter_with_row_parallelism_patterns"] == [r"^o\.weight$"]
assert info["tp_replicated_parameter_patterns"] == [r"^n\.bias$", r"^n\.weight$", r"^o\.bias$"]
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
for cls in (DeepSpeedZeroOptimizer, FP16_Optimizer):
    with pytest.raises(NotImplementedError, match="engine.optimizer is the torch optimizer"):
        cls()
from deepspeed.git_version_info import torch_info
assert is_current_accelerator_supported() and torch_info["version"] == ".".join(torch.__version__.split(".")[:2])
""" + _ZERO_LINEAR_PROBE + """
print("ok")
"""

# DeepSpeed's internal names that the compat package provides over shardwise
_INTERNALS_PROBE = r"""
import types
# DeepSpeed's engine classes subclass shardwise's (nothing is set on shardwise's Engine); initialize builds them
import deepspeed
from shardwise.runtime.engine import Engine
assert not hasattr(Engine, "_mixed_precision_dtypes") and not hasattr(Engine, "_config")
assert issubclass(deepspeed.DeepSpeedEngine, Engine) and deepspeed.DeepSpeedEngine is not Engine
assert issubclass(deepspeed.PipelineEngine, deepspeed.DeepSpeedEngine)
assert issubclass(deepspeed.DeepSpeedHybridEngine, deepspeed.DeepSpeedEngine)
engine, *_ = deepspeed.initialize(model=torch.nn.Linear(2, 2), config={"train_batch_size": 1, "gradient_clipping": 0.25,
                                                                       "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
assert type(engine) is deepspeed.DeepSpeedEngine and engine.gradient_clipping() == 0.25
assert engine._mixed_precision_dtypes() == (None, None) and engine._config.gradient_clipping == 0.25
with engine.no_sync():  # DeepSpeed's engine refuses a nested no_sync (shardwise's Engine nests them)
    with pytest.raises(AssertionError, match="no_sync context manager reentry is unsupported"):
        with engine.no_sync():
            pass
    assert engine.train_step.no_sync_depth == 1
with engine.no_sync():  # the refused one left nothing behind
    assert engine.train_step.no_sync_depth == 1
assert engine.train_step.no_sync_depth == 0
# moved out of shardwise/: DeepSpeed paths only
from deepspeed.checkpoint.utils import clone_tensors_for_torch_save
base = torch.arange(6.0)
saved = clone_tensors_for_torch_save({"a": base[:2], "b": [base[4:]]})
assert saved["a"].untyped_storage().nbytes() == 8 and torch.equal(saved["b"][0], base[4:])
from deepspeed.profiling.flops_profiler import get_model_profile
from shardwise.profiling import get_model_profile as own
assert get_model_profile is own
from deepspeed.runtime.engine import DeepSpeedEngine
fake = lambda pd=None, bd=None, bf16=False: types.SimpleNamespace(
    _config=types.SimpleNamespace(param_dtype=pd, buffer_dtype=bd, gradient_clipping=0.5),
    fp16_enabled=lambda: False, bfloat16_enabled=lambda: bf16)
assert DeepSpeedEngine._mixed_precision_dtypes(fake(bd="float16", bf16=True)) == (torch.bfloat16, torch.float16)
assert DeepSpeedEngine._mixed_precision_dtypes(fake()) == (None, None) and DeepSpeedEngine.gradient_clipping(fake()) == 0.5
DeepSpeedEngine._assert_valid_mixed_precision_config(fake(pd="bf16", bf16=True))
with pytest.raises(AssertionError, match="conflicts with the enabled precision"):
    DeepSpeedEngine._assert_valid_mixed_precision_config(fake(pd="bf16"))
m = torch.nn.Linear(2, 2)
m.register_buffer("keep", torch.ones(2))
m.register_buffer("cast", torch.ones(2))
import re
DeepSpeedEngine._cast_module_mixed_precision(types.SimpleNamespace(module=m), torch.half, torch.bfloat16, False,
                                              re.compile("keep"))
assert (m.weight.dtype, m.keep.dtype, m.cast.dtype) == (torch.half, torch.float32, torch.bfloat16)
from deepspeed.runtime.config import DeepSpeedConfig  # what engine._config is: DeepSpeed's flat names
c = DeepSpeedConfig({"train_batch_size": 2, "bf16": {"enabled": True}, "data_types": {"buffer_dtype": "fp32"},
                     "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 5}})
assert (c.zero_config.prefetch_bucket_size, c.zero_optimization_stage, c.bfloat16_enabled, c.fp16_enabled,
        c.buffer_dtype, c.param_dtype, c.train_batch_size) == (5, 3, True, False, "fp32", None, 2)
with pytest.raises(ValueError, match="'sum' is not supported with ZeRO stage 3"):  # DeepSpeed's config refuses it
    DeepSpeedConfig({"train_batch_size": 1, "gradient_allreduce_op": "sum", "zero_optimization": {"stage": 3}})
assert DeepSpeedConfig({"train_batch_size": 1, "gradient_allreduce_op": "sum",
                        "zero_optimization": {"stage": 2}}).gradient_allreduce_op == "sum"
# the constructors DeepSpeed's zero.Init swaps, under its module's names (tests rebind them around an Init)
import deepspeed.runtime.zero.partition_parameters as pp
assert (pp._orig_torch_empty, pp._orig_torch_zeros, pp._orig_torch_full) == (torch.empty, torch.zeros, torch.full)
# DeepSpeed's config base class: aliases, deprecated fields moved to their replacement, "auto" as unset
from typing import List, Optional
from pydantic import Field, ValidationError
from deepspeed.runtime.config_utils import DeepSpeedConfigModel
class Conf(DeepSpeedConfigModel):
    a: int = 0
    old: Optional[str] = Field(None, json_schema_extra={"deprecated": True, "new_param": "new",
                                                        "new_param_fn": lambda x: [x]})
    new: Optional[List[str]] = None
    b: int = Field(0, alias="b_alias")
assert Conf(old="x").new == ["x"] and Conf(b_alias=3).b == 3 == Conf(b=3).b and Conf(a="auto").a == 0
with pytest.raises(AssertionError, match="together"):
    Conf(old="x", new=["y"])
for bad in ({"a": "x"}, {"typo": 1}):
    with pytest.raises(ValidationError):
        Conf(**bad)
# pinned-memory accounting: a log line at 32 GB, 64 GB, 128 GB, ...
from deepspeed.utils.pin_memory_tracker import _fmt_bytes, _tracker, track_pinned_memory
_tracker.reset()
track_pinned_memory(40 << 30)
track_pinned_memory(100 << 30)
assert (_tracker._bytes, _tracker._calls, _tracker._next_checkpoint) == (140 << 30, 2, 256 << 30)
assert [_fmt_bytes(n) for n in (512, 2048, 1 << 20)] == ["512 B", "2.0 KB", "1.00 MB"]
# DeepSpeed's comms-logger record layout: summaries do not reorder what was recorded
from deepspeed.utils.comms_logging import CommsLogger
from deepspeed.utils.timer import trim_mean
log = CommsLogger()
for ms in (3.0, 1.0, 2.0):
    log.append("all_reduce", "all_reduce", ms, 1024)
raw = log.get_raw_data()["all_reduce"][1024]
assert raw[0] == 3 and raw[1] == [3.0, 1.0, 2.0] and raw[2][0] < raw[2][1]
assert log.get_operation_summary("all_reduce")[1024]["avg_latency_ms"] == 2.0 and log.get_raw_data()["all_reduce"][1024] == raw
assert trim_mean([9.0, 1.0, 5.0, 5.0, 5.0, 5.0, 5.0, 5.0, 5.0, 5.0], 0.1) == 5.0 and log.get_total_operations() == 3
# a launcher backend's exports: quoted for the remote shell only when needed
from deepspeed.launcher.multinode_runner import MultiNodeRunner
class Runner(MultiNodeRunner):
    backend_exists = get_cmd = lambda *a: None
r = Runner(types.SimpleNamespace(user_args=["--x"], user_script="s.py"), "info")
r.add_export("A", " /usr/lib/python3/site-packages ")
r.add_export("B", "64(x2)")
r.add_export("C", 'say "$HOME"')
assert r.exports == {"A": "/usr/lib/python3/site-packages", "B": '"64(x2)"', "C": '"say \\"\\$HOME\\""'}
assert r.user_arguments == ["--x"] and r.name == "Runner"
# how many parameters the running backward reaches
from deepspeed.runtime.utils import count_used_parameters_in_backward
p, q, frozen = (torch.nn.Parameter(torch.ones(1)) for _ in range(3))
frozen.requires_grad_(False)
seen = []
p.register_hook(lambda g: seen.append(count_used_parameters_in_backward([p, q, frozen])))
(p * 2 + frozen).sum().backward()
assert seen == [1]
with pytest.raises(RuntimeError, match="during a backward"):
    count_used_parameters_in_backward([p])
# DeepSpeed's stand-alone clipping and overflow helpers (one process: no averaging over ranks)
from deepspeed.runtime.utils import CheckOverflow, clip_grad_norm_
def grads(*values):
    ps = [torch.nn.Parameter(torch.zeros(len(v))) for v in values]
    for p, v in zip(ps, values):
        p.grad = torch.tensor(v)
    return ps
mine, ref = grads([3.0, 1.0], [2.0]), grads([3.0, 1.0], [2.0])
assert torch.equal(clip_grad_norm_(mine, 0.5), torch.nn.utils.clip_grad_norm_(ref, 0.5))
assert all(torch.equal(a.grad, b.grad) for a, b in zip(mine, ref))
assert not CheckOverflow([grads([1.0])]).check() and CheckOverflow([grads([1.0], [float("nan")])]).check()
from deepspeed.runtime.utils import get_weight_norm  # the values' norm (not the gradients'); -1 for inf/NaN
w = [torch.nn.Parameter(torch.tensor([3.0, 4.0])), torch.tensor([-12.0])]
assert get_weight_norm(w) == 13.0 and get_weight_norm(w, norm_type=float("inf")) == 12.0
assert get_weight_norm(w, norm_type=1) == 19.0 and get_weight_norm(torch.tensor([6.0, 8.0])) == 10.0
assert get_weight_norm([torch.tensor([1.0, float("inf")])]) == -1 == get_weight_norm([torch.tensor([float("nan")])])
assert CheckOverflow([grads([1.0])]).check_using_norm([-1], reduce_overflow=False)
assert not CheckOverflow([grads([1.0])]).check_using_norm([get_weight_norm(w)], reduce_overflow=False)
print("ok")
"""


def test_compat_package_paths_and_adapters(tmp_path):
    """The compat package (compat/deepspeed, imported from the source tree): DeepSpeed's module paths moved
    out of shardwise/, the config views, the launcher helpers, and names that refuse with a reason."""
    for moved in ("runtime/pipe", "runtime/zero", "module_inject", "runtime/lr_schedules.py", "launcher/runner.py",
                  "runtime/activation_checkpointing/checkpointing.py", "profiling/flops_profiler.py",
                  "checkpoint/utils.py", "runtime/sequence_parallel/parallel_state_sp.py"):
        assert not (REPO / "shardwise" / moved).exists(), f"shardwise/{moved} mirrors a DeepSpeed path: compat/ holds it"
    compat = REPO / "compat" / "deepspeed"
    probe = tmp_path / "probe.py"
    probe.write_text(_COMPAT_PROBE + _INTERNALS_PROBE)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(compat), str(REPO)])}
    out = subprocess.run([sys.executable, str(probe), str(compat)], env=env, capture_output=True, text=True,
                         timeout=120, cwd=tmp_path)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


def test_initialize_without_a_model_raises_value_and_assertion_error():
    """DeepSpeed asserts a model is given; shardwise's error is a ValueError that is also an AssertionError."""
    import shardwise

    with pytest.raises(ValueError, match=r"needs model=\.\.\.$"):
        shardwise.initialize(config={"train_batch_size": 1})
    with pytest.raises(AssertionError, match="a model given first is taken as args"):
        shardwise.initialize(torch.nn.Linear(2, 2), config={"train_batch_size": 1})


def test_dotted_top_level_keys_are_ignored_as_deepspeed_does(caplog):
    # TRL's prepare_deepspeed adds these (accelerate's "fill auto" form) and passes the dict to initialize;
    # DeepSpeed reads nested blocks only, so they change nothing there either.
    from shardwise.config import ConfigError, load_config

    cfg = {"train_batch_size": 2, "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto"},
           "zero_optimization.reduce_bucket_size": 1024, "zero_optimization.stage3_prefetch_bucket_size": 921.6,
           "zero_optimization.stage3_param_persistence_threshold": 320}
    with caplog.at_level("WARNING", logger="shardwise"):
        zc = load_config(cfg).zero_optimization
    assert (zc.stage, zc.reduce_bucket_size, zc.stage3_prefetch_bucket_size) == (3, 500_000_000, 50_000_000)
    assert "ignoring top-level zero_optimization.reduce_bucket_size" in caplog.text
    with pytest.raises(ConfigError, match="zero_optimization.bogus: unknown key"):
        load_config({"train_batch_size": 2, "zero_optimization.bogus": 1})
