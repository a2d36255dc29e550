"""The environment a multi-node launch exports to every node.

Remote shells start with a bare environment, so the launcher passes on:
* every variable whose name starts with one of ``EXPORT_PREFIXES`` (NCCL_*, PYTHON*,
  CUDA_*, ...), taken from the launcher's own environment;
* every ``KEY=VALUE`` line of ``.shardwise_env`` and DeepSpeed's ``.deepspeed_env``, looked
  for in the home folder and then the working folder (later files win), or of the file
  named by ``SHARDWISE_ENV_FILE`` / ``DS_ENV_FILE``.
"""
from __future__ import annotations

import os
import re
from typing import Mapping

EXPORT_PREFIXES = ("NCCL_", "PYTHON", "CUDA_", "GLOO_", "TORCH_", "OMP_", "MKL_", "UCX_", "MLFLOW",
                   "HF_", "WANDB_", "SHARDWISE_", "DEEPSPEED_")
ENV_FILE_NAMES = (".deepspeed_env", ".shardwise_env")  # the second wins on a clash
_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def parse_env_file(path: str) -> dict[str, str]:
    """``KEY=VALUE`` lines; ``#`` comments and blank lines skipped; ValueError naming file:line."""
    out: dict[str, str] = {}
    with open(path) as f:
        for lineno, raw in enumerate(f, start=1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            key, sep, value = line.partition("=")
            key = key.strip()
            if line.startswith("export "):
                key = key[len("export "):].strip()
            if not sep or not _KEY.match(key):
                raise ValueError(f"{path}:{lineno}: expected KEY=VALUE, got {line!r}")
            out[key] = value.strip()
    return out


def env_files(*, cwd: str, home: str, environ: Mapping[str, str]) -> list[str]:
    named = environ.get("SHARDWISE_ENV_FILE") or environ.get("DS_ENV_FILE")
    if named:
        if not os.path.isfile(named):
            raise ValueError(f"SHARDWISE_ENV_FILE/DS_ENV_FILE names {named!r}, which does not exist")
        return [named]
    found = []
    for folder in dict.fromkeys([home, cwd]):  # home first, so the working folder wins
        for name in ENV_FILE_NAMES:
            path = os.path.join(folder, name)
            if os.path.isfile(path):
                found.append(path)
    return found


def exported_env(*, environ: Mapping[str, str] | None = None, cwd: str | None = None,
                 home: str | None = None) -> dict[str, str]:
    """Variables to set on every node, in a stable order."""
    environ = os.environ if environ is None else environ
    out = {k: v for k, v in sorted(environ.items()) if k.startswith(EXPORT_PREFIXES)}
    for path in env_files(cwd=cwd or os.getcwd(), home=home or os.path.expanduser("~"),
                          environ=environ):
        out.update(parse_env_file(path))
    return out
