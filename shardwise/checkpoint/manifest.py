"""Finding a checkpoint folder and reading its manifest (no engine, no process group needed).

    ckpt = open_checkpoint("checkpoints")          # the tag in 'latest'
    ckpt = open_checkpoint("checkpoints", tag="global_step100")
    ckpt.verify()                                  # every file against its size and sha256
    ckpt.manifest["engine"]["global_steps"]

The manifest checks itself: ``digest`` is the sha256 of the rest of it (canonical JSON), so an
edited shape or a file dropped from ``files`` is refused on open; and every file the manifest
refers to (fragments, the shared files, each saving rank's RNG files) must be listed in ``files``.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from shardwise.checkpoint.files import OLD_PREFIX, TMP_PREFIX, read_tensors, verify_file

logger = logging.getLogger("shardwise")

FORMAT = "shardwise-checkpoint"
VERSION = 2  # 2: the manifest carries its own digest
SHARED_FILES = ("model.safetensors", "extra.safetensors")


def manifest_digest(manifest: dict) -> str:
    """sha256 of the manifest without its ``digest`` field, as canonical JSON."""
    body = {k: v for k, v in manifest.items() if k != "digest"}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode()).hexdigest()


def _fragment_files(node) -> set[str]:
    if isinstance(node, dict):
        found = {node["file"]} if isinstance(node.get("file"), str) else set()
        for value in node.values():
            found |= _fragment_files(value)
        return found
    if isinstance(node, list):
        return set().union(*(_fragment_files(v) for v in node)) if node else set()
    return set()


def expected_files(manifest: dict) -> set[str]:
    """Every file a load reads: the shared files, each fragment's file, and rank<r>.json/.safetensors
    for every rank of the job that saved (unless the manifest says no rank state was saved: a checkpoint
    converted from DeepSpeed's layout, which keeps no RNG states; the digest covers that flag)."""
    world = int(manifest.get("topology", {}).get("world_size", 0))
    if manifest.get("rank_states") is False:
        world = 0
    names = set(SHARED_FILES) | _fragment_files(manifest.get("tensors", {}))
    for r in range(world):
        names |= {f"rank{r}.json", f"rank{r}.safetensors"}
    return names


def check_manifest(manifest: dict, where: Path) -> None:
    """Refuse a manifest that was changed after it was written, or that does not list a file it needs."""
    digest = manifest.get("digest")
    if digest is None:
        if manifest.get("version", 0) >= 2:
            raise ValueError(f"checkpoint manifest {where} has no 'digest' (its own checksum); it was edited or "
                             "damaged, and nothing in it can be trusted")
        logger.warning("checkpoint manifest %s was written before manifests carried their own checksum; "
                       "it is not verified", where)
    elif digest != manifest_digest(manifest):
        raise ValueError(f"checkpoint manifest {where} was changed after it was written: its digest {digest} does "
                         f"not match its content (sha256 {manifest_digest(manifest)}); a shape, a tensor entry or "
                         "the file list differs from what the save wrote")
    files = manifest.get("files")
    if not isinstance(files, dict):
        raise ValueError(f"checkpoint manifest {where} has no 'files' list")
    unlisted = sorted(expected_files(manifest) - set(files))
    if unlisted:
        raise ValueError(f"checkpoint manifest {where} does not list {', '.join(unlisted)} among its files, "
                         "though the checkpoint needs them (a rank's state would silently not be restored)")


def list_tags(save_dir: Path) -> list[str]:
    """Tags of the complete checkpoints in ``save_dir`` (folders holding a manifest)."""
    save_dir = Path(save_dir)
    if not save_dir.is_dir():
        return []
    tags = set()
    for p in save_dir.iterdir():
        if p.name.startswith(TMP_PREFIX) or not (p / "manifest.json").exists():
            continue
        tags.add(p.name.removeprefix(OLD_PREFIX))
    return sorted(tags)


def resolve_tag(load_dir: Path, tag=None) -> str | None:
    """``tag``, or the one named in ``load_dir/latest``; None when neither exists."""
    if tag is not None:
        return str(tag)
    return read_latest(load_dir)


def read_latest(load_dir, *, name: str = "latest") -> str | None:
    """The tag named in ``load_dir/latest`` (None without that file), read defensively: the file must be
    UTF-8 text naming one folder inside ``load_dir`` (no ``/``, ``..`` or NUL), whatever wrote it (this
    format or DeepSpeed's); anything else is a ValueError naming the file.  ``name``: another such file
    (DeepSpeed's universal checkpoints have ``latest_universal``)."""
    load_dir = Path(load_dir)
    latest = load_dir / name
    if not latest.is_file():
        return None
    raw = latest.read_bytes()
    try:
        tag = raw.decode("utf-8").strip()
    except UnicodeDecodeError as e:
        raise ValueError(f"{latest} is not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start}); it should "
                         f"hold one checkpoint tag such as 'global_step100'; {_folders_hint(load_dir)}") from None
    if not tag or any(c in tag for c in "/\\\0") or tag in (".", ".."):
        raise ValueError(f"{latest} does not hold a checkpoint tag (got {tag!r}): a tag names one folder inside "
                         f"{load_dir}; {_folders_hint(load_dir)}")
    return tag


def _folders_hint(load_dir: Path) -> str:
    tags = list_tags(load_dir) or sorted(p.name for p in load_dir.iterdir() if p.is_dir() and not p.name.startswith("."))
    return f"tags in {load_dir}: {', '.join(tags) or 'none'}"


def checkpoint_folder(load_dir: Path, tag: str) -> Path:
    """The folder holding ``tag``; ``.old.<tag>`` when a re-save of that tag was interrupted."""
    load_dir = Path(load_dir)
    folder = load_dir / tag
    if (folder / "manifest.json").exists():
        return folder
    old = load_dir / (OLD_PREFIX + tag)
    if (old / "manifest.json").exists():
        logger.warning("checkpoint %s: a re-save of this tag was interrupted; loading the previous copy %s",
                       folder, old)
        return old
    raise FileNotFoundError(f"no checkpoint '{tag}' in {load_dir}; tags there: "
                            f"{', '.join(list_tags(load_dir)) or 'none'}")


@dataclass
class Checkpoint:
    folder: Path
    tag: str
    manifest: dict
    _verified: set = field(default_factory=set)

    def path(self, name: str) -> Path:
        return self.folder / name

    def check(self, name: str) -> Path:
        """Verify one file (once) against the manifest and return its path."""
        path = self.folder / name
        if name not in self._verified:
            if name not in self.manifest["files"]:
                raise ValueError(f"{path} is not listed in {self.folder / 'manifest.json'}")
            verify_file(path, self.manifest["files"][name], self.manifest.get("sizes", {}).get(name))
            self._verified.add(name)
        return path

    def read(self, name: str) -> dict[str, torch.Tensor]:
        path = self.check(name)
        return read_tensors(path, None)

    def verify(self) -> None:
        """Check every file listed in the manifest; raise on the first that is missing or corrupted."""
        for name in sorted(self.manifest["files"]):
            self.check(name)


def open_checkpoint(load_dir, tag=None) -> Checkpoint | None:
    """The checkpoint ``tag`` (default: the one in ``latest``) of ``load_dir``; None without ``latest``.

    ``load_dir`` may also be one tag's folder itself (it holds ``manifest.json``)."""
    load_dir = Path(load_dir)
    if tag is None and (load_dir / "manifest.json").exists():
        folder, tag = load_dir, load_dir.name.removeprefix(OLD_PREFIX)
    else:
        tag = resolve_tag(load_dir, tag)
        if tag is None:
            return None
        folder = checkpoint_folder(load_dir, tag)
    where = folder / "manifest.json"
    try:
        manifest = json.loads(where.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"checkpoint manifest {where} is corrupted or truncated: {e}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ValueError(f"{where} is not a shardwise checkpoint manifest")
    if manifest.get("version", 0) > VERSION:
        raise ValueError(f"{where} has format version {manifest['version']}; this shardwise reads up to {VERSION}")
    check_manifest(manifest, where)
    return Checkpoint(folder=folder, tag=tag, manifest=manifest)
