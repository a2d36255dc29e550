"""Atomic, checksummed file writing for checkpoints, and recovery from an interrupted save.

A save writes ``<save_dir>/.tmp.<tag>/``, fsyncs it and renames it to ``<tag>``.  Saving a tag
that already exists moves the old folder to ``.old.<tag>`` first, so a crash between the two
renames leaves ``.old.<tag>`` (complete) and no ``<tag>``: loading falls back to it, and the
next save puts it back (:func:`recover_interrupted`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

logger = logging.getLogger("shardwise")

TMP_PREFIX, OLD_PREFIX = ".tmp.", ".old."


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


def write_tensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None,
                  *, copy: bool = True) -> str:
    """Write a safetensors file, fsync it, and return its sha256.

    ``copy=False`` when the tensors are already private CPU copies (an asynchronous snapshot);
    otherwise they are copied, because safetensors refuses tensors that share storage (our
    parameters are views of one flat buffer)."""
    if copy:
        tensors = {k: v.detach().cpu().clone().contiguous() for k, v in tensors.items()}
    save_file(tensors, str(path), metadata=metadata)
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
    """Move a completed ``tmp_dir`` to ``final_dir``, replacing an older one of the same tag.

    Every state a crash can leave is recoverable: before the first rename the old folder is
    intact; between the renames it is ``.old.<tag>`` (used by :func:`checkpoint_folder`, restored
    by :func:`recover_interrupted`); after the second the new folder is in place and
    ``.old.<tag>`` is debris."""
    fsync_dir(tmp_dir)
    old = None
    if final_dir.exists():
        old = final_dir.with_name(OLD_PREFIX + final_dir.name)
        if old.exists():
            shutil.rmtree(old)
        os.rename(final_dir, old)
        fsync_dir(final_dir.parent)
    os.rename(tmp_dir, final_dir)
    fsync_dir(final_dir.parent)
    if old is not None:
        shutil.rmtree(old)


def recover_interrupted(save_dir: Path) -> None:
    """Undo what an interrupted save left in ``save_dir`` (call on one rank, before saving).

    ``.old.<tag>`` without ``<tag>`` goes back to ``<tag>``; ``.old.<tag>`` beside ``<tag>``,
    every ``.tmp.<tag>`` and a stale ``.latest.tmp`` are removed."""
    if not save_dir.is_dir():
        return
    for p in sorted(save_dir.iterdir()):
        if p.name.startswith(OLD_PREFIX) and p.is_dir():
            final = save_dir / p.name[len(OLD_PREFIX):]
            if final.exists():
                shutil.rmtree(p)
            else:
                logger.warning("checkpoint %s: an earlier save of this tag was interrupted; restoring the "
                               "previous copy", final)
                os.rename(p, final)
                fsync_dir(save_dir)
        elif p.name.startswith(TMP_PREFIX) and p.is_dir():
            shutil.rmtree(p)
        elif p.name == ".latest.tmp":  # replace_text_atomically's, killed before its rename
            p.unlink()


def verify_file(path: Path, expected_sha256: str | None, expected_size: int | None = None) -> None:
    """Raise a clear error when ``path`` is missing, truncated or does not match its checksum."""
    if not path.exists():
        raise FileNotFoundError(f"checkpoint file missing: {path}")
    size = path.stat().st_size
    if expected_size is not None and size != expected_size:
        what = "truncated" if size < expected_size else "too long"
        raise ValueError(f"checkpoint file {path} is corrupted ({what}): {size} bytes, the manifest says "
                         f"{expected_size} (sha256 will not match {expected_sha256})")
    if expected_sha256 is not None:
        actual = sha256(path)
        if actual != expected_sha256:
            raise ValueError(f"checkpoint file {path} is corrupted: sha256 {actual} does not match the "
                             f"manifest's {expected_sha256}")


def read_tensors(path: Path, expected_sha256: str | None, expected_size: int | None = None) -> dict[str, torch.Tensor]:
    verify_file(path, expected_sha256, expected_size)
    return load_file(str(path))


def save_state_dict_atomically(state: dict[str, torch.Tensor], path) -> None:
    """A whole state dict as one safetensors file, written to a temporary name and renamed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    write_tensors(tmp, state)
    os.replace(tmp, path)
    fsync_dir(path.parent)
