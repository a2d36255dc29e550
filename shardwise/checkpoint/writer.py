"""Writing one checkpoint's files and committing it, now or in a background thread.

A save is planned on every rank (which tensors go to which file, the manifest without
checksums) and then *written*: each rank writes its files into ``.tmp.<tag>`` and reports
``{file: (sha256, size)}``; rank 0 merges the reports into the manifest, writes it, renames the
folder into place and updates ``latest``.

Synchronous saves report through a collective.  Asynchronous saves
(``checkpoint.writer.decoupled``) run the writing in a thread per rank while training goes on;
the thread reports by writing ``.done.rank<r>.json`` into the folder and rank 0's thread commits
once every rank's report is there, so no collective runs outside the main thread.  The next
save, a load, ``engine.wait_for_checkpoint()`` and interpreter exit wait for the thread.
"""

from __future__ import annotations

import atexit
import json
import logging
import threading
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import torch

from shardwise.checkpoint.manifest import manifest_digest
from shardwise.checkpoint.files import publish_dir, replace_text_atomically, write_json, write_tensors

logger = logging.getLogger("shardwise")

DONE_PREFIX = ".done.rank"
COMMIT_TIMEOUT_S = 1800.0  # how long rank 0 waits for the other ranks' files


@dataclass
class SavePlan:
    """What one rank writes for one checkpoint."""

    tmp: Path
    final: Path
    rank: int
    world: int
    tensors: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)  # file -> tensors
    json_files: dict[str, object] = field(default_factory=dict)  # file -> JSON object
    written: dict[str, tuple[str, int]] = field(default_factory=dict)  # already on disk: file -> (sha, size)
    manifest: dict | None = None  # rank 0: everything but "files"/"sizes"
    save_latest: bool = True
    copied: bool = False  # tensors are private CPU copies (asynchronous snapshot)

    failed: str | None = None  # the first error of write_now, reported by try_write_files

    def write_now(self, name: str, tensors: dict[str, torch.Tensor]) -> None:
        """Write one file at once (a synchronous save streaming NVMe-offloaded state); an error is kept
        for :meth:`try_write_files`, so this rank still joins the collectives that follow."""
        if self.failed is not None:
            return
        try:
            self.written[name] = (write_tensors(self.tmp / name, tensors), 0)
        except Exception as e:
            self.failed = f"rank {self.rank} could not write {self.tmp / name}: {type(e).__name__}: {e}"

    def write_files(self) -> dict[str, tuple[str, int]]:
        shas = {name: sha for name, (sha, _) in self.written.items()}
        for name, tensors in self.tensors.items():
            shas[name] = write_tensors(self.tmp / name, tensors, copy=not self.copied)
        for name, obj in self.json_files.items():
            shas[name] = write_json(self.tmp / name, obj)
        return {name: (sha, (self.tmp / name).stat().st_size) for name, sha in shas.items()}

    def try_write_files(self) -> dict | str:
        """:meth:`write_files`, or the error that stopped it as text (a full disk, read-only storage),
        so every rank learns of it through the gather that follows instead of waiting for a rank
        that has left the save."""
        if self.failed is not None:
            return self.failed
        try:
            return self.write_files()
        except Exception as e:  # safetensors reports ENOSPC as its own error type
            return f"rank {self.rank} could not write its files into {self.tmp}: {type(e).__name__}: {e}"

    def try_commit(self, reports: list) -> str | None:
        """Rank 0: :meth:`commit`, or its error as text; ``latest`` is only moved once everything is on disk."""
        try:
            self.commit(reports)
            return None
        except Exception as e:
            return f"rank 0 could not commit {self.final}: {type(e).__name__}: {e}"

    def commit(self, reports: list[dict[str, tuple[str, int]]]) -> None:
        """Rank 0: write the manifest with every rank's checksums, publish, point ``latest`` here."""
        assert self.rank == 0 and self.manifest is not None
        files, sizes = {}, {}
        for report in reports:
            for name, (sha, size) in report.items():
                files[name], sizes[name] = sha, size
        manifest = {**self.manifest, "files": files, "sizes": sizes}
        manifest["digest"] = manifest_digest(manifest)
        write_json(self.tmp / "manifest.json", manifest)
        publish_dir(self.tmp, self.final)
        if self.save_latest:
            replace_text_atomically(self.final.parent / "latest", self.final.name)


class SaveFailed(OSError):
    """A checkpoint save failed on some rank; raised on every rank, naming each failure. The previous
    checkpoint and ``latest`` are untouched."""


def raise_if_failed(outcomes: list, what: str) -> None:
    """Every rank, after gathering each rank's outcome: raise :class:`SaveFailed` if any is an error text."""
    errors = [o for o in outcomes if isinstance(o, str)]
    if errors:
        raise SaveFailed(f"{what} failed; 'latest' was not changed (it names the previous checkpoint, if there "
                         "was one):\n  " + "\n  ".join(errors))


def try_prepare(save_dir: Path, tmp: Path) -> str | None:
    """Rank 0: create ``save_dir`` and an empty ``tmp`` (after clearing debris of interrupted saves), or
    the error as text (read-only storage, a full disk, no permission)."""
    import shutil

    from shardwise.checkpoint.files import recover_interrupted
    try:
        save_dir.mkdir(parents=True, exist_ok=True)
        recover_interrupted(save_dir)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        return None
    except OSError as e:
        return f"rank 0 could not prepare {tmp}: {type(e).__name__}: {e}"


def snapshot(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Private contiguous CPU copies, safe to write while training changes the originals."""
    return {k: v.detach().to("cpu", copy=True).contiguous() for k, v in tensors.items()}


def _done_file(tmp: Path, rank: int) -> Path:
    return tmp / f"{DONE_PREFIX}{rank}.json"


def _write_in_background(plan: SavePlan) -> None:
    try:
        report = {k: list(v) for k, v in plan.write_files().items()}
    except BaseException as e:  # tell rank 0, which would otherwise wait for this rank's files
        write_json(_done_file(plan.tmp, plan.rank),
                   {"error": f"rank {plan.rank} could not write its files into {plan.tmp}: {type(e).__name__}: {e}"})
        raise
    write_json(_done_file(plan.tmp, plan.rank), report)
    if plan.rank != 0:
        return
    deadline = time.monotonic() + COMMIT_TIMEOUT_S
    missing = list(range(plan.world))
    while True:
        missing = [r for r in missing if not _done_file(plan.tmp, r).exists()]
        if not missing:
            break
        if time.monotonic() > deadline:
            raise TimeoutError(f"asynchronous checkpoint {plan.final}: rank(s) {missing} did not finish writing "
                               f"into {plan.tmp} within {COMMIT_TIMEOUT_S:g} s")
        time.sleep(0.005)
    reports = []
    for r in range(plan.world):
        done = _done_file(plan.tmp, r)
        report = json.loads(done.read_text())
        if "error" in report:  # the report names the rank and the folder
            raise RuntimeError(f"{plan.final} was not committed: {report['error']}")
        reports.append({k: tuple(v) for k, v in report.items()})
        done.unlink()
    plan.commit(reports)


class CheckpointWriter:
    """At most one asynchronous save of an engine in flight."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._what = ""
        _live.add(self)

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self, plan: SavePlan) -> None:
        self.wait()
        self._what = str(plan.final)
        self._error = None

        def run() -> None:
            try:
                _write_in_background(plan)
            except BaseException as e:  # reported by wait()
                self._error = e

        self._thread = threading.Thread(target=run, name=f"shardwise-ckpt-{plan.final.name}", daemon=False)
        self._thread.start()

    def wait(self) -> bool:
        """Block until this rank's part of the save in flight (if any) is written — on rank 0, until
        the checkpoint is committed; raise its error.  True when a save was in flight."""
        if self._thread is None:
            return False
        self._thread.join()
        self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"asynchronous checkpoint save of {self._what} failed: {error}") from error
        return True


_live: "weakref.WeakSet[CheckpointWriter]" = weakref.WeakSet()


@atexit.register
def _wait_all_at_exit() -> None:
    for w in list(_live):
        try:
            w.wait()
        except RuntimeError as e:
            logger.error("%s", e)
