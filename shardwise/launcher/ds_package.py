"""Which ``deepspeed`` this Python imports: none, shardwise's compatibility package
(compat/deepspeed, version ``0.19.8+shardwise.<version>``) or a real DeepSpeed.

Read from the package metadata and the import system's spec only: nothing is imported (a real
DeepSpeed's import is slow and may build extensions).
"""
from __future__ import annotations

import importlib.util
from importlib import metadata


def deepspeed_package() -> tuple[str, str]:
    """``(kind, description)``; kind is ``"none"``, ``"shardwise"``, ``"deepspeed"`` or ``"unknown"``."""
    try:
        spec = importlib.util.find_spec("deepspeed")
    except (ImportError, ValueError):
        spec = None
    try:
        dist = metadata.distribution("deepspeed")
    except metadata.PackageNotFoundError:
        dist = None
    where = f" ({spec.origin})" if spec is not None and spec.origin else ""
    if spec is None:
        return "none", ("not installed: scripts use 'import shardwise as deepspeed'; for Hugging Face "
                        "Trainer/accelerate: pip install ./compat/deepspeed (docs/hf-trainer.md)")
    if dist is None:
        return "unknown", (f"a 'deepspeed' module without package metadata{where}: Hugging Face libraries "
                           "treat DeepSpeed as not installed")
    if "+shardwise" in dist.version:
        return "shardwise", (f"shardwise's compatibility package {dist.version}{where}: 'import deepspeed' and "
                             "the 'deepspeed' command run shardwise")
    return "deepspeed", (f"DeepSpeed {dist.version}{where}: 'import deepspeed' and the 'deepspeed' command run "
                         "DeepSpeed, not shardwise")
