"""Launcher runs of real training: a rank killed with SIGKILL is restarted and resumes from the
last checkpoint; a rank that stops calling collectives makes the job fail with a report."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = "tests/scripts/train_resume.py"


def _launch(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    return subprocess.run([sys.executable, "-m", "shardwise", "run", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_killed_rank_restarts_and_resumes_from_the_last_checkpoint(tmp_path: Path) -> None:
    ref, run = tmp_path / "ref", tmp_path / "run"
    plain = _launch("--num_procs", "2", "--bind_cores_to_rank", SCRIPT, "--save_dir", str(ref),
                    "--out", str(tmp_path / "ref.json"))
    assert plain.returncode == 0, plain.stderr
    restarted = _launch("--num_procs", "2", "--max_restarts", "1", SCRIPT, "--save_dir", str(run),
                        "--out", str(tmp_path / "run.json"), "--kill_at", "6")
    assert restarted.returncode == 0, restarted.stderr
    out = restarted.stdout
    assert "[rank1]: rank 1 kills itself with SIGKILL" in out
    assert "failed (exitcode: -9) local_rank: 1" in restarted.stderr  # the agent saw the kill
    for rank in (0, 1):  # attempt 1 resumed from the checkpoint of step 4 (saved every 4 steps)
        assert re.search(rf"\[rank{rank}\]: attempt 1 starts at step 4 \(loaded .*global_step4\)",
                         out), out
    a, b = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("ref", "run"))
    assert b["attempt"] == 1 and a["steps"] == b["steps"] == 12
    assert b["params"] == a["params"]  # bitwise the same as the uninterrupted run
    assert b["losses"] == a["losses"][4:]
    # --bind_cores_to_rank: each rank got its own share of the cores
    cores = sorted(os.sched_getaffinity(0))
    bound = [json.loads((tmp_path / f"ref.json.rank{r}").read_text()) for r in (0, 1)]
    half = len(cores) // 2 or 1
    assert bound[0]["cores"] == cores[:half] and bound[0]["omp"] == str(half)
    if len(cores) >= 2:
        assert bound[1]["cores"] == cores[half:2 * half] and not set(bound[0]["cores"]) & set(bound[1]["cores"])


def test_stalled_rank_makes_every_rank_report_and_the_job_fail(tmp_path: Path) -> None:
    start = time.monotonic()
    proc = _launch("--num_procs", "2", "--comm_timeout", "4", SCRIPT, "--save_dir",
                   str(tmp_path / "ck"), "--out", str(tmp_path / "o.json"), "--stall_at", "3",
                   "--save_every", "100", timeout=90)
    took = time.monotonic() - start
    assert proc.returncode == 1, proc.stderr
    assert took < 40, took  # the sleeping rank would hold the job for 120 s
    text = proc.stdout + proc.stderr
    assert "[rank1]: rank 1 stops calling collectives" in text
    # rank 0 names the collective: the first bucket's all_reduce of step 4 (2 micro-steps a step)
    m = re.search(r"shardwise.comm.CollectiveTimeoutError: rank 0: all_reduce #(\d+) on world \(2 ranks\): "
                  r"float32\[\d+\], [\d.]+ \w+ did not complete \(timed out\) after [\d.]+ s "
                  r"\(collective timeout 4 s\)", text)
    assert m, text
    seq = int(m.group(1))
    assert f"rank 0: in all_reduce #{seq} on world for" in text
    assert re.search(rf"rank 1: not in a collective for [\d.]+ s \(last completed: all_reduce "
                     rf"#{seq - 1} on world\); main thread at .*train_resume.py", text), text
    assert "train_resume.py" in text and "time.sleep(120)" in text  # where rank 1 was
    # the stalled rank reported too, from its watchdog thread
    assert re.search(r"\[rank1\]: \[shardwise\] rank 1 \(.*\): rank 0 reported that all_reduce "
                     rf"#{seq} on world timed out; this rank is not in a collective", text), text
    assert "[shardwise] rank 0 (local rank 0, pid" in proc.stderr  # the launcher's summary
