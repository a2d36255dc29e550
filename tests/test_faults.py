"""Fault injection (issue 18): what a kill -9, a full disk, read-only storage or a cut network
does to a job, and that shardwise keeps its promises (docs/reliability.md).

Kept fast: tiny models, 2 ranks, a few trials each. The long SIGKILL-during-save loop of a
single process is tests/test_checkpoint_crash.py; a hanging rank in a collective is
tests/test_comm_timeout.py; a killed node agent of a multi-node job is
tests/test_launcher_multinode.py.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
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


def _read_ready(proc: subprocess.Popen, count: int, timeout: float) -> list[int]:
    """Pids from the first ``count`` 'ready pid=N' lines the ranks print."""
    pids: list[int] = []
    deadline = time.monotonic() + timeout
    assert proc.stdout is not None
    while len(pids) < count and time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        m = re.search(r"ready pid=(\d+)", line)
        if m:
            pids.append(int(m.group(1)))
    return pids


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_kill9_of_the_launcher_leaves_no_orphan_ranks() -> None:
    """Issue 18 item 1: SIGKILL of `shardwise run` left both ranks training (new session, no
    parent-death signal). Now they die with it, within a second or two."""
    for trial in range(2):
        proc = subprocess.Popen([*RUN, "--num_procs", "2", "tests/scripts/sleep_or_fail.py"], cwd=REPO,
                                env=_env(), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                start_new_session=True)
        ranks: list[int] = []
        try:
            ranks = _read_ready(proc, 2, timeout=60)
            assert len(ranks) == 2, "the ranks did not start"
            if trial == 1:
                time.sleep(0.5)  # a little later in their life
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
            left = _wait_gone(ranks, timeout=10)
            assert not left, f"trial {trial}: ranks {left} outlived the SIGKILLed launcher"
        finally:
            for pid in [proc.pid, *ranks]:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            proc.wait()
