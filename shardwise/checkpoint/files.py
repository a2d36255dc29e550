"""Atomic, checksummed file writing for checkpoints."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def write_tensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> str:
    """Write a safetensors file, fsync it, and return its sha256."""
    # safetensors refuses tensors that share storage (our params are views of one buffer): copy.
    save_file({k: v.detach().cpu().clone().contiguous() for k, v in tensors.items()}, str(path), metadata=metadata)
    fsync_file(path)
    return sha256(path)


def write_json(path: Path, obj) -> str:
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return sha256(path)


def replace_text_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def publish_dir(tmp_dir: Path, final_dir: Path) -> None:
    """Move a completed ``tmp_dir`` to ``final_dir``, replacing an older one of the same tag."""
    fsync_dir(tmp_dir)
    old = None
    if final_dir.exists():
        old = final_dir.with_name(f".old.{final_dir.name}")
        if old.exists():
            shutil.rmtree(old)
        os.rename(final_dir, old)
    os.rename(tmp_dir, final_dir)
    fsync_dir(final_dir.parent)
    if old is not None:
        shutil.rmtree(old)


def read_tensors(path: Path, expected_sha256: str | None) -> dict[str, torch.Tensor]:
    if not path.exists():
        raise FileNotFoundError(f"checkpoint file missing: {path}")
    if expected_sha256 is not None:
        actual = sha256(path)
        if actual != expected_sha256:
            raise ValueError(
                f"checkpoint file {path} is corrupted: sha256 {actual} does not match the manifest's {expected_sha256}"
            )
    return load_file(str(path))


def save_state_dict_atomically(state: dict[str, torch.Tensor], path) -> None:
    """A whole state dict as one safetensors file, written to a temporary name and renamed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    write_tensors(tmp, state)
    os.replace(tmp, path)
    fsync_dir(path.parent)
