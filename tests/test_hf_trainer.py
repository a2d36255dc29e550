"""Hugging Face Trainer on shardwise through the opt-in ``deepspeed`` package (compat/deepspeed).

In a venv where ``deepspeed`` is that package (tests/compat_venv.py; no real DeepSpeed anywhere):
* the package is what transformers and accelerate see as DeepSpeed, and every ``deepspeed.X`` is
  shardwise's module; ``shardwise doctor`` says which deepspeed is active;
* building it over a real DeepSpeed is refused unless pip is given --force-reinstall (the doctor names
  that DeepSpeed);
* an unchanged Trainer script (``TrainingArguments(deepspeed=cfg, use_cpu=True)``, tiny random Llama,
  2 processes, gradient accumulation 2) gives DDP's losses at ZeRO-2 and at ZeRO-3 with
  ``zero.Init``, saves models ``from_pretrained`` loads with DDP's trained weights, and resumes from its
  checkpoint folder continuing identically;
* accelerate's own path, ``accelerate launch --use_deepspeed`` and ``Accelerator(deepspeed_plugin=
  DeepSpeedPlugin(...))`` with a client optimizer, matches one-process training at ZeRO-2 and ZeRO-3;
* the example's seed-style command (``deepspeed --num_gpus 2 main.py --deepspeed ds_config.json
  --do_train ... --use_cpu``) trains, and ``shardwise serve`` answers with the trained weights.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

from compat_venv import COMPAT, REPO, compat_venv, venv_env

SCRIPT = REPO / "tests" / "scripts" / "hf_trainer_llama.py"
EXAMPLE = REPO / "examples" / "hf_trainer"
TOL = 1e-5


@pytest.fixture(scope="module")
def venv() -> Path:
    return compat_venv()


def _run(cmd, env, cwd, timeout=300) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{cmd} failed ({proc.returncode}):\n{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}"
    return proc


def _state(folder) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# ------------------------------------------------------------------------------- the package

_PROBE = r"""
import importlib.metadata as md, importlib.util, json, sys
import deepspeed, shardwise
from transformers.integrations.deepspeed import is_deepspeed_available as hf_available
from accelerate.utils import is_deepspeed_available as acc_available
import deepspeed.runtime.zero.partition_parameters as pp
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.ops.adam import DeepSpeedCPUAdam
out = {
    "version": deepspeed.__version__, "dist_version": md.version("deepspeed"), "flag": deepspeed.__shardwise__,
    "hf": hf_available(), "accelerate": bool(acc_available()),
    "same_engine": DeepSpeedEngine is deepspeed.DeepSpeedEngine and DeepSpeedEngine.__bases__[1] is shardwise.runtime.engine.Engine
                   and not hasattr(shardwise.runtime.engine.Engine, "_config"),  # a subclass: shardwise's Engine untouched
    "same_module": sys.modules["deepspeed.runtime.engine"].DeepSpeedEngine is DeepSpeedEngine
                   and issubclass(pp.GatheredParameters, shardwise.zero.GatheredParameters),
    "spec_kept": sys.modules["deepspeed.runtime.engine"].__spec__.name,
    "same_adam": DeepSpeedCPUAdam is sys.modules["shardwise.ops.adam"].DeepSpeedCPUAdam,
    "lr_schedules": "WarmupLR" in deepspeed.runtime.lr_schedules.VALID_LR_SCHEDULES,
    "init": issubclass(deepspeed.zero.Init, shardwise.zero.Init) and deepspeed.zero.Init is pp.Init,
}
import deepspeed.runtime.domino.transformer as domino  # DeepSpeed's tree imports whole; its unsupported names
try:                                                  # raise when used
    domino.DominoTransformer()
except NotImplementedError as exc:
    out["domino"] = str(exc)
import contextlib, io
from shardwise.cli import main
with contextlib.redirect_stdout(io.StringIO()) as doctor:
    main(["doctor"])
out["doctor"] = doctor.getvalue()
print(json.dumps(out))
"""


def test_compat_package_is_deepspeed_for_hf_and_maps_every_path(venv, tmp_path, monkeypatch, capsys):
    python = str(venv / "bin" / "python")
    got = json.loads(_run([python, "-c", _PROBE], venv_env(venv), tmp_path).stdout.strip().splitlines()[-1])
    assert got["version"] == got["dist_version"] and got["version"].startswith("0.19.8+shardwise.")
    assert got["flag"] is True and got["hf"] and got["accelerate"]
    assert got["same_engine"] and got["same_module"] and got["same_adam"] and got["init"] and got["lr_schedules"]
    assert got["spec_kept"] == "deepspeed.runtime.engine"  # the compat module (DeepSpeedEngine, DeepSpeed's helpers)
    assert "deepspeed.runtime.domino.transformer.DominoTransformer is not supported by shardwise: Domino" in got["domino"]

    assert "deepspeed: shardwise's compatibility package 0.19.8+shardwise." in got["doctor"]

    # the `deepspeed` command is `shardwise run`
    helped = _run([str(venv / "bin" / "deepspeed"), "--help"], venv_env(venv, COLUMNS="100"), tmp_path).stdout
    assert helped == _cli_output(["run", "--help"], monkeypatch, capsys)
    # without the package (this interpreter) the doctor says so
    assert "deepspeed: not installed" in _cli_output(["doctor"], monkeypatch, capsys)


def _cli_output(argv, monkeypatch, capsys) -> str:
    from shardwise.cli import main

    monkeypatch.setenv("COLUMNS", "100")
    capsys.readouterr()
    try:
        main(argv)
    except SystemExit:
        pass
    return capsys.readouterr().out


def _fake_real_deepspeed(site: Path) -> None:
    (site / "deepspeed").mkdir()
    (site / "deepspeed" / "__init__.py").write_text("REAL = True\n")
    info = site / "deepspeed-0.19.8.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: deepspeed\nVersion: 0.19.8\n")
    (info / "INSTALLER").write_text("pip\n")
    (info / "RECORD").write_text("deepspeed/__init__.py,,\ndeepspeed-0.19.8.dist-info/METADATA,,\n"
                                 "deepspeed-0.19.8.dist-info/INSTALLER,,\ndeepspeed-0.19.8.dist-info/RECORD,,\n")


def test_refuses_to_replace_a_real_deepspeed_without_force_reinstall(tmp_path):
    root = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
    python = str(root / "bin" / "python")
    site = Path(subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    (site / "_base.pth").write_text(f"import site; site.addsitedir({sysconfig.get_paths()['purelib']!r})\n")
    _fake_real_deepspeed(site)
    src = tmp_path / "compat"
    shutil.copytree(COMPAT, src, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PIP_FORCE_REINSTALL")}
    pip = [python, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index", str(src)]
    refused = subprocess.run(pip, env=env, capture_output=True, text=True, timeout=300)
    assert refused.returncode != 0
    assert "refusing to install" in refused.stdout + refused.stderr
    assert "real DeepSpeed 0.19.8" in refused.stdout + refused.stderr
    assert (site / "deepspeed" / "__init__.py").read_text() == "REAL = True\n"  # untouched
    doctor = _run([python, "-m", "shardwise", "doctor"], {**env, "PYTHONPATH": str(REPO)}, tmp_path).stdout
    assert "deepspeed: DeepSpeed 0.19.8" in doctor and "run DeepSpeed, not shardwise" in doctor

    _run([*pip, "--force-reinstall"], env, tmp_path)
    check = "import deepspeed, importlib.metadata as m; print(deepspeed.__shardwise__, m.version('deepspeed'))"
    out = _run([python, "-c", check], {**env, "PYTHONPATH": str(REPO)}, tmp_path).stdout.split()
    assert out[0] == "True" and out[1].startswith("0.19.8+shardwise.")


# ------------------------------------------------------------------------------- Trainer parity

def _tiny_llama(folder: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=True)
    LlamaForCausalLM(config).save_pretrained(str(folder))


def _ds_config(stage: int) -> dict:
    zero = {"stage": stage, "reduce_bucket_size": "auto", "overlap_comm": True, "contiguous_gradients": True}
    if stage == 3:
        zero.update({"stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto",
                     "stage3_gather_16bit_weights_on_model_save": True})
    return {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
            "train_batch_size": "auto", "gradient_clipping": "auto", "zero_optimization": zero,
            "fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"}}


def test_trainer_zero2_and_zero3_match_ddp_save_and_resume(venv, tmp_path):
    model = tmp_path / "tiny-llama"
    _tiny_llama(model)
    configs = []
    for stage in (2, 3):
        path = tmp_path / f"zero{stage}.json"
        path.write_text(json.dumps(_ds_config(stage)))
        configs.append(str(path))
    report = tmp_path / "report.json"
    _run([str(venv / "bin" / "python"), "-m", "shardwise", "run", "--num_gpus", "2", str(SCRIPT),
          "--model", str(model), "--out", str(tmp_path / "out"), "--report", str(report),
          "--deepspeed", "none", *configs, "--resume_from_step", "3", "--grad_accum", "2"],
         venv_env(venv), tmp_path, timeout=600)
    runs = json.loads(report.read_text())

    ddp = runs["ddp"]
    assert ddp["wrapper"].endswith("DistributedDataParallel") and ddp["steps"] == [1, 2, 3, 4, 5]
    assert len(set(ddp["loss"])) == 5  # the reference really trains (losses move)
    for name in ("zero2", "zero3"):
        run, resumed = runs[name], runs[name + "-resume"]
        assert run["wrapper"] == "deepspeed.runtime.engine.DeepSpeedEngine", name  # (a subclass of shardwise's Engine)
        assert run["partitioned_at_load"] == (name == "zero3"), name  # from_pretrained under zero.Init
        assert run["steps"] == resumed["steps"] == [1, 2, 3, 4, 5], name
        assert run["loss"] == pytest.approx(ddp["loss"], abs=TOL), name
        assert run["grad_norm"] == pytest.approx(ddp["grad_norm"], abs=TOL), name
        assert run["lr"] == pytest.approx(ddp["lr"], abs=1e-12), name
        # steps 4-5 were trained again after loading checkpoint-3 (weights, optimizer, scheduler, data position)
        assert resumed["loss"][3:] == pytest.approx(run["loss"][3:], abs=TOL), name
        assert resumed["grad_norm"][3:] == pytest.approx(run["grad_norm"][3:], abs=TOL), name
        ckpt = tmp_path / "out" / name / "checkpoint-3"
        assert (ckpt / "global_step3").is_dir() and (ckpt / "latest").read_text().strip() == "global_step3"

    initial, trained = _state(model), _state(tmp_path / "out" / "ddp" / "final")
    assert max((initial[k] - trained[k]).abs().max().item() for k in trained) > 1e-3
    for folder in ("zero2", "zero2-resume", "zero3", "zero3-resume"):
        got = _state(tmp_path / "out" / folder / "final")
        assert set(got) == set(trained), folder
        for k, v in trained.items():
            torch.testing.assert_close(got[k], v, atol=TOL, rtol=0, msg=f"{folder}: {k}")


def test_accelerate_deepspeed_plugin_zero2_zero3_match_one_process(venv, tmp_path):
    report = tmp_path / "report.json"
    # launched by `accelerate launch --use_deepspeed` (it reads deepspeed.launcher.runner, then torch's launcher)
    _run([str(venv / "bin" / "python"), "-m", "accelerate.commands.launch", "--use_deepspeed", "--num_processes", "2",
          "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--zero_stage", "2",
          str(REPO / "tests" / "scripts" / "accelerate_loop.py"), "--report", str(report)],
         venv_env(venv), tmp_path, timeout=600)
    for name, run in json.loads(report.read_text()).items():
        assert run["engine"] == "deepspeed.runtime.engine.DeepSpeedEngine" and run["stage"] == int(name[-1]), name
        assert run["steps"] == 4, name  # 8 micro-batches, accumulation 2
        assert run["losses"] == pytest.approx(run["ref_rank0_losses"], abs=TOL), name
        assert run["max_weight_diff"] < TOL, name  # accelerator.get_state_dict() vs one-process training


# ------------------------------------------------------------------------------- the example

def test_example_seed_command_trains_and_serves(venv, tmp_path):
    from test_serve import reference_answer, running_server  # (puts examples/chat on sys.path)
    from make_tiny_model import make_tiny_model, texts_from_files

    spec = importlib.util.spec_from_file_location("hf_trainer_example_main", EXAMPLE / "main.py")
    example = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # (its dataclasses need it there)
    spec.loader.exec_module(example)
    data = REPO / "examples" / "chat" / "train.json"
    model = make_tiny_model(str(tmp_path / "tiny"), texts_from_files([str(data)]), vocab_size=400, init_std=0.3,
                            seed=3)
    out = tmp_path / "out"
    _run([str(venv / "bin" / "deepspeed"), "--num_gpus", "2", str(EXAMPLE / "main.py"),
          "--deepspeed", str(EXAMPLE / "ds_config.json"), "--do_train", "--train_file", str(data),
          "--prompt_column", "prompt", "--response_column", "response", "--history_column", "history",
          "--model_name_or_path", model, "--output_dir", str(out), "--max_steps", "3",
          "--per_device_train_batch_size", "2", "--learning_rate", "1e-2", "--save_strategy", "no",
          "--report_to", "none", "--use_cpu", "--disable_tqdm", "true"], venv_env(venv), tmp_path, timeout=600)
    assert json.loads((out / "train_results.json").read_text())["train_loss"] > 0
    initial, trained = _state(model), _state(out)
    assert max((initial[k] - trained[k]).abs().max().item() for k in trained) > 1e-3

    history = [["", "您好，请问是张先生吗？"], ["是。", "喂"]]
    with running_server(str(out), "--max_new_tokens", "12", log_path=str(tmp_path / "serve.log")) as url:
        import httpx

        r = httpx.post(url, json={"prompt": "什么事。", "history": history}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["response"] == reference_answer(str(out), example.build_prompt("什么事。", history))
