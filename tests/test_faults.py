"""Fault injection: what a kill -9, a full disk, read-only storage or a cut network
does to a job, and that shardwise keeps its promises (docs/reliability.md).

Kept fast: tiny models, 2 ranks, a few trials each. The long SIGKILL-during-save loop of a
single process is tests/test_checkpoint_crash.py; a hanging rank in a collective is
tests/test_comm_timeout.py; a killed node agent of a multi-node job is
tests/test_launcher_multinode.py.
"""
from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
RUN = [sys.executable, "-m", "shardwise", "run"]


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **extra}


def _alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie waiting for a parent to reap it counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in ("Z", "X")


def _wait_gone(pids: list[int], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while True:
        alive = [p for p in pids if _alive(p)]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.1)


class _Job:
    """`shardwise run --num_procs 2 tests/scripts/save_loop.py`: its output lines, collected by a thread."""

    def __init__(self, save_dir: Path) -> None:
        self.proc = subprocess.Popen([*RUN, "--num_procs", "2", "tests/scripts/save_loop.py", "--save_dir",
                                      str(save_dir)], cwd=REPO, env=_env(), stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    def ranks(self) -> list[int]:
        return [int(m.group(1)) for line in list(self.lines) if (m := re.search(r"ready pid=(\d+)", line))]

    def saved(self) -> int:
        found = [int(m.group(1)) for line in list(self.lines) if (m := re.search(r"saved (\d+)", line))]
        return max(found, default=0)

    def wait_for(self, what, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not what():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError("the job did not get there:\n" + "".join(self.lines[-30:]))
            time.sleep(0.02)

    def kill_everything(self) -> None:
        for pid in [self.proc.pid, *self.ranks()]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()


TARGETS = ("launcher", "one rank", "whole job")
# launches in the kill test; each resumes from what the previous one left (a soak: SHARDWISE_FAULT_TRIALS=30)
TRIALS = int(os.environ.get("SHARDWISE_FAULT_TRIALS", "4"))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_kill9_at_random_points_of_saves(tmp_path: Path) -> None:
    """SIGKILL of the launcher, of one rank, or of every process, in turn, while two ranks save a
    checkpoint after every step: no process outlives the job (nothing of torch's own stops the ranks
    when the launcher is killed), `latest` names a complete checkpoint that passes every checksum and
    is at least as new as the last save that returned, and the next launch resumes from it."""
    from shardwise.checkpoint import open_checkpoint

    rng = random.Random()
    seed = rng.randrange(1 << 30)
    rng.seed(seed)
    save_dir = tmp_path / "ckpt"
    resume_from = 0
    for trial in range(TRIALS):
        target = TARGETS[trial % len(TARGETS)]
        where = f"trial {trial} ({target}, seed {seed})"
        job = _Job(save_dir)
        try:
            job.wait_for(lambda: len(job.ranks()) == 2 and job.saved() >= resume_from + 2, timeout=120)
            first = min(int(m.group(1)) for line in list(job.lines) if (m := re.search(r"saved (\d+)", line)))
            assert first == resume_from + 1, f"{where}: resumed at step {first - 1}, not {resume_from}"
            time.sleep(rng.uniform(0.0, 0.2))
            ranks, last_saved = job.ranks(), job.saved()
            if target == "launcher":
                os.kill(job.proc.pid, signal.SIGKILL)
            elif target == "one rank":
                os.kill(rng.choice(ranks), signal.SIGKILL)
            else:
                for pid in [job.proc.pid, *ranks]:
                    os.kill(pid, signal.SIGKILL)
            job.proc.wait(timeout=60)
            left = _wait_gone(ranks, timeout=15)
            assert not left, f"{where}: ranks {left} outlived the SIGKILL"
            if target == "one rank":
                assert job.proc.returncode != 0, where
        finally:
            job.kill_everything()
        ckpt = open_checkpoint(save_dir)
        assert ckpt is not None, f"{where}: no checkpoint after {last_saved} saves"
        ckpt.verify()
        resume_from = ckpt.manifest["engine"]["global_steps"]
        assert resume_from >= last_saved, (where, ckpt.tag, last_saved)


# ---------------------------------------------------------------- full disk, read-only storage

def _mount(kind: str, path: Path, *, size: str = "") -> bool:
    """A real tmpfs (``kind`` "tmpfs") or a read-only bind mount of ``path`` ("ro"); False without the right."""
    path.mkdir(parents=True, exist_ok=True)
    if kind == "tmpfs":
        cmd = ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)]
    else:
        cmd = ["sh", "-c", f"mount --bind '{path}' '{path}' && mount -o remount,ro,bind '{path}'"]
    if os.geteuid() != 0:
        return False
    return subprocess.run(cmd, capture_output=True).returncode == 0


def _umount(path: Path) -> None:
    subprocess.run(["umount", "-l", str(path)], capture_output=True)


def _storage_body(rank: int, world: int, root: str, full_disk: bool) -> dict:
    """Save t1, then fill the disk (or lose write access) and save t2: every rank must get the same
    clear error, 'latest' must stay on t1; after space comes back, saving works again."""
    import errno

    import shardwise
    from models import base_config, make_data, make_model, mse
    from shardwise.checkpoint import writer

    torch_model = make_model()
    engine = shardwise.initialize(model=torch_model, config=base_config(zero_optimization={"stage": 1}))[0]
    x, y = make_data(3, 8)
    save_dir = Path(root) / "disk" / "ckpt"
    engine.backward(mse(engine(x[0][rank * 4:(rank + 1) * 4]), y[0][rank * 4:(rank + 1) * 4]))
    engine.step()
    engine.save_checkpoint(save_dir, tag="t1")
    out = {"mounted": Path(root, "mounted").exists()}
    restore = None
    if out["mounted"]:
        shardwise.comm.barrier()
        if rank == 0:  # the test process fills it up or remounts it read-only; wait for its signal
            Path(root, "go").write_text("1")
        while not Path(root, "ready").exists():
            __import__("time").sleep(0.02)
        shardwise.comm.barrier()
    elif rank == world - 1:  # no mount rights: inject the error the kernel would give, on one rank
        real = writer.write_tensors

        def failing(path, *a, **kw):
            code = errno.ENOSPC if full_disk else errno.EROFS
            raise OSError(code, os.strerror(code), str(path))
        writer.write_tensors = failing
        restore = real
    engine.backward(mse(engine(x[1][rank * 4:(rank + 1) * 4]), y[1][rank * 4:(rank + 1) * 4]))
    engine.step()
    try:
        engine.save_checkpoint(save_dir, tag="t2")
        out["error"] = None
    except OSError as e:
        out["error"] = f"{type(e).__name__}: {e}"
    out["latest"] = (save_dir / "latest").read_text()
    if restore is not None:
        writer.write_tensors = restore
    shardwise.comm.barrier()
    if out["mounted"]:
        if rank == 0:
            Path(root, "release").write_text("1")
        while not Path(root, "released").exists():
            __import__("time").sleep(0.02)
        shardwise.comm.barrier()
    engine.save_checkpoint(save_dir, tag="t3")  # space / write access is back
    out["latest_after"] = (save_dir / "latest").read_text()
    return out


def _run_storage_case(tmp_path: Path, full_disk: bool):
    """Run the body in 2 ranks; when mounting works (root), a real tmpfs filled to the brim or a
    read-only remount is applied from here between the two saves."""
    from distributed import run_distributed

    disk = tmp_path / "disk"
    mounted = _mount("tmpfs", disk, size="8m")
    if mounted:
        (tmp_path / "mounted").write_text("1")

    def controller():
        while not (tmp_path / "go").exists():
            time.sleep(0.02)
        if full_disk:  # leave less room than a checkpoint needs
            used = sum(f.stat().st_size for f in (disk / "ckpt").rglob("*") if f.is_file())
            free = os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize
            with open(disk / "filler", "wb") as f:
                f.write(b"\0" * max(0, free - used // 3))
        else:
            subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
        (tmp_path / "ready").write_text("1")
        while not (tmp_path / "release").exists():
            time.sleep(0.02)
        if full_disk:
            (disk / "filler").unlink()
        else:
            subprocess.run(["mount", "-o", "remount,rw", str(disk)], check=True)
        (tmp_path / "released").write_text("1")

    helper = threading.Thread(target=controller, daemon=True) if mounted else None
    if helper:
        helper.start()
    try:
        results = run_distributed(_storage_body, 2, args=(str(tmp_path), full_disk), timeout=120)
    finally:
        if mounted:
            _umount(disk)
    return mounted, results


@pytest.mark.parametrize("full_disk", [True, False], ids=["full-disk", "read-only"])
def test_full_disk_or_read_only_storage_during_a_save(tmp_path: Path, full_disk: bool) -> None:
    """A full disk (a real tmpfs filled up, or an injected ENOSPC without mount rights) or read-only
    storage during a save: the same clear error on every rank (no rank left waiting in a
    collective), `latest` still on the previous checkpoint, and saving works once space is back."""
    mounted, results = _run_storage_case(tmp_path, full_disk)
    for rank, r in enumerate(results):
        assert r["mounted"] == mounted
        error = r["error"]
        assert error is not None, f"rank {rank}: the save on a {'full' if full_disk else 'read-only'} disk passed"
        assert error.startswith("SaveFailed: saving t2 failed; 'latest' was not changed (it names the previous "
                                "checkpoint, if there was one)"), error
        assert ("No space left on device" if full_disk else "Read-only file system") in error, error
        assert r["latest"] == "t1", r["latest"]
        assert r["latest_after"] == "t3"


# ---------------------------------------------------------------- how a stop is reported

def test_sigint_stops_as_fast_as_sigterm_and_a_killed_rank_is_named(tmp_path: Path) -> None:
    """Ctrl-C (SIGINT to the launcher) stops the job as fast as SIGTERM, within 3 s (forwarded as
    SIGINT, each worker's KeyboardInterrupt would wait in its collective until the agent's SIGKILL,
    2-5 s). A rank killed with SIGKILL is reported as "was killed by SIGKILL"."""
    times = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        job = _Job(tmp_path / "ckpt")
        try:
            job.wait_for(lambda: len(job.ranks()) == 2 and job.saved() >= 2, timeout=120)
            ranks, started = job.ranks(), time.monotonic()
            os.kill(job.proc.pid, sig)
            job.proc.wait(timeout=60)
            times[sig.name] = time.monotonic() - started
            assert not _wait_gone(ranks, timeout=10)
            assert job.proc.returncode == 128 + sig, job.proc.returncode
            assert f"stopped by {sig.name}; the workers were terminated" in "".join(job.lines)
        finally:
            job.kill_everything()
    assert times["SIGINT"] < 3.0, times

    job = _Job(tmp_path / "ckpt")
    try:
        job.wait_for(lambda: len(job.ranks()) == 2 and job.saved() >= 1, timeout=120)
        victim = next(int(m.group(1)) for line in list(job.lines)
                      if (m := re.search(r"\[rank1\]: ready pid=(\d+)", line)))
        os.kill(victim, signal.SIGKILL)
        job.proc.wait(timeout=60)
    finally:
        job.kill_everything()
    out = "".join(job.lines)
    assert re.search(rf"rank 1 \(local rank 1, pid {victim}\) was killed by SIGKILL; the other ranks were stopped",
                     out), out[-2000:]
    assert "failed with killed" not in out
