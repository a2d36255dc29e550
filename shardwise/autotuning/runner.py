"""Running one trial: write its config, launch the user's script with ``shardwise run``, read its metrics."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field

from shardwise.launcher.options import LaunchOptions

CONFIG_FLAGS = ("--deepspeed_config", "--shardwise_config", "--deepscale_config")


def launcher_flags(opts: LaunchOptions) -> list[str]:
    """The ``shardwise run`` flags that reproduce ``opts`` (everything but the script and its arguments)."""
    defaults = LaunchOptions(script="")
    flags: list[str] = []
    for f in dataclasses.fields(LaunchOptions):
        if f.name in ("script", "script_args"):
            continue
        value = getattr(opts, f.name)
        if value == getattr(defaults, f.name):
            continue
        if isinstance(value, bool):
            flags.append(f"--{f.name}")
        else:
            flags += [f"--{f.name}", str(value)]
    return flags


def find_config_arg(script_args: list[str]) -> tuple[int, str]:
    """(index of the value, path) of ``--deepspeed_config PATH`` (or ``=PATH``) in the script's arguments."""
    for i, arg in enumerate(script_args):
        for flag in CONFIG_FLAGS:
            if arg == flag and i + 1 < len(script_args):
                return i + 1, script_args[i + 1]
            if arg.startswith(flag + "="):
                return i, arg.split("=", 1)[1]
    raise ValueError("autotune: the script's arguments need --deepspeed_config PATH (the config to tune)")


def config_value(config: dict, key: str):
    """The value of ``key`` in ``config``, else in the blocks nested in it (depth first, the first found that is
    not None); None when it is nowhere. An ``arg_mappings`` key names a config key wherever it sits
    (``"device"`` finds ``zero_optimization.offload_optimizer.device``), as DeepSpeed's autotuner reads it."""
    if key in config:
        return config[key]
    for value in config.values():
        if isinstance(value, dict):
            found = config_value(value, key)
            if found is not None:
                return found
    return None


def clean_arg_mappings(arg_mappings: dict | None) -> dict[str, str]:
    """``autotuning.arg_mappings`` (config key -> the script's flag) with the spaces around each name dropped;
    of two keys that are the same once stripped, the first wins."""
    out: dict[str, str] = {}
    for key, flag in (arg_mappings or {}).items():
        out.setdefault(key.strip(), flag.strip())
    return out


def _set_arg(args: list[str], flag: str, value) -> list[str]:
    """Set ``flag``'s value in ``args`` (appending ``flag value`` when it is absent)."""
    args = list(args)
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            args[i + 1] = str(value)
            return args
        if a.startswith(flag + "="):
            args[i] = f"{flag}={value}"
            return args
    return args + [flag, str(value)]


@dataclass
class TrialResult:
    name: str
    exp_dir: str
    status: str  # "ok", "failed (exit N)", "timeout", "ended early" (before end_profile_step)
    seconds: float
    metrics: dict | None = None
    settings: dict = field(default_factory=dict)  # stage, micro_batch, ... for the summary

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


class TrialRunner:
    def __init__(self, *, opts: LaunchOptions, exps_dir: str, timeout: float, arg_mappings: dict | None = None,
                 overwrite: bool = True) -> None:
        self.opts = opts
        self.exps_dir = exps_dir
        self.timeout = timeout
        self.arg_mappings = clean_arg_mappings(arg_mappings)
        self.overwrite = overwrite
        self.config_index, self.user_config_path = find_config_arg(opts.script_args)

    def command(self, config_path: str, config: dict) -> list[str]:
        args = list(self.opts.script_args)
        i = self.config_index
        args[i] = config_path if not args[i].startswith("--") else args[i].split("=", 1)[0] + "=" + config_path
        for key, flag in self.arg_mappings.items():  # e.g. train_micro_batch_size_per_gpu -> --per_device_batch
            value = config_value(config, key)
            if value is not None and str(value) != "auto":  # "auto": the script works it out itself
                args = _set_arg(args, flag, value)
        return [sys.executable, "-m", "shardwise", "run", *launcher_flags(self.opts), self.opts.script, *args]

    def run(self, name: str, config: dict, *, metric_file: str, settings: dict | None = None) -> TrialResult:
        exp_dir = os.path.join(self.exps_dir, name)
        metric_path = os.path.join(exp_dir, metric_file)
        config_path = os.path.join(exp_dir, "ds_config.json")
        if not self.overwrite and os.path.isfile(metric_path):
            with open(config_path) as f:
                if json.load(f) == config:  # the same trial already ran: reuse its result
                    with open(metric_path) as m:
                        return TrialResult(name, exp_dir, "ok", 0.0, json.load(m), dict(settings or {}))
        shutil.rmtree(exp_dir, ignore_errors=True)
        os.makedirs(exp_dir)
        with open(config_path, "w") as f:
            json.dump(config, f, indent=2)
        cmd = self.command(config_path, config)
        with open(os.path.join(exp_dir, "cmd.txt"), "w") as f:
            f.write(" ".join(cmd) + "\n")
        t0 = time.perf_counter()
        with open(os.path.join(exp_dir, "stdout.log"), "w") as log:
            try:
                proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=self.timeout,
                                      env={**os.environ, "PYTHONUNBUFFERED": "1"})
                status = "ok" if proc.returncode == 0 else f"failed (exit {proc.returncode})"
            except subprocess.TimeoutExpired:
                status = "timeout"
        seconds = time.perf_counter() - t0
        metrics = None
        if status == "ok":
            if os.path.isfile(metric_path):
                with open(metric_path) as f:
                    metrics = json.load(f)
            else:
                status = "ended early"  # the script finished before end_profile_step
        return TrialResult(name, exp_dir, status, seconds, metrics, dict(settings or {}))
