"""Fault injection, repeated: kill -9 (a rank, the launcher, the whole job mid-save), SIGTERM,
SIGINT and a full disk, N times each, against two ranks of ``shardwise run`` saving a checkpoint
after every step (tests/scripts/save_loop.py). Prints a table of tried / held.

    python benchmarks/fault_injection.py --trials 5

Not part of CI (a few minutes at N=5); the fast versions are tests/test_faults.py, whose
machinery this reuses. What "held" means for each fault:

* kill -9 of a rank: the launcher exits non-zero within 10 s, its summary names the rank as
  "was killed by SIGKILL", no process outlives it, ``latest`` verifies, the next launch resumes
  from it.
* kill -9 of the launcher: no rank outlives it (parent-death signal); ``latest`` verifies; resume.
* kill -9 of every process mid-save: ``latest`` verifies, is at least as new as the last save
  that returned; resume.
* SIGTERM / SIGINT to the launcher: it exits 143 / 130 within 3 s saying "stopped by SIGTERM /
  SIGINT", no rank outlives it, ``latest`` verifies; resume.
* disk full during a save (a real 8 MB tmpfs filled up when run as root; an injected ENOSPC on one
  rank otherwise): every rank raises the same ``SaveFailed`` naming the error, ``latest`` stays
  on the previous checkpoint, the next save works.
"""
from __future__ import annotations

import argparse
import os
import random
import re
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO))

from test_faults import _Job, _run_storage_case, _wait_gone  # noqa: E402


class Outcome:
    def __init__(self) -> None:
        self.tried = 0
        self.held = 0
        self.seconds: list[float] = []
        self.failures: list[str] = []

    def record(self, problems: list[str], seconds: float | None = None) -> None:
        self.tried += 1
        self.held += not problems
        if seconds is not None:
            self.seconds.append(seconds)
        self.failures.extend(problems)


def _check_latest(save_dir: Path, last_saved: int) -> tuple[int, list[str]]:
    from shardwise.checkpoint import open_checkpoint

    try:
        ckpt = open_checkpoint(save_dir)
        if ckpt is None:
            return 0, ["no checkpoint"]
        ckpt.verify()
    except Exception as exc:  # recorded as a broken promise, and the loop goes on
        return 0, [f"latest does not verify: {exc}"]
    step = ckpt.manifest["engine"]["global_steps"]
    return step, ([] if step >= last_saved else [f"latest is step {step}, but step {last_saved} had been saved"])


def process_fault(kind: str, save_dir: Path, resume_from: int, rng: random.Random) -> tuple[int, list[str], float]:
    """One launch, one fault; returns (the step the next launch resumes from, problems, seconds to stop)."""
    job = _Job(save_dir)
    problems: list[str] = []
    last_saved, stopped = resume_from, float("nan")
    try:
        try:
            job.wait_for(lambda: len(job.ranks()) == 2 and job.saved() >= resume_from + 2, timeout=180)
        except AssertionError as exc:
            return resume_from, [f"the launch did not get going: {exc}"], stopped
        first = min(int(m.group(1)) for line in list(job.lines) if (m := re.search(r"saved (\d+)", line)))
        if first != resume_from + 1:
            problems.append(f"resumed at step {first - 1}, not {resume_from}")
        time.sleep(rng.uniform(0.0, 0.2))
        ranks, last_saved = job.ranks(), job.saved()
        victim = rng.choice(ranks)
        started = time.monotonic()
        if kind == "kill -9 a rank":
            os.kill(victim, signal.SIGKILL)
        elif kind == "kill -9 the launcher":
            os.kill(job.proc.pid, signal.SIGKILL)
        elif kind == "kill -9 everything (mid-save)":
            for pid in [job.proc.pid, *ranks]:
                os.kill(pid, signal.SIGKILL)
        else:
            os.kill(job.proc.pid, signal.SIGTERM if kind == "SIGTERM the launcher" else signal.SIGINT)
        job.proc.wait(timeout=60)
        stopped = time.monotonic() - started
        left = _wait_gone(ranks, timeout=15)
        if left:
            problems.append(f"ranks {left} outlived the fault")
        output = "".join(job.lines)
        code = job.proc.returncode
        if kind == "kill -9 a rank":
            rank = next(int(m.group(1)) for line in job.lines
                        if (m := re.search(rf"\[rank(\d+)\]: ready pid={victim}\b", line)))
            if code == 0 or stopped > 10:
                problems.append(f"launcher exit {code} after {stopped:.1f} s")
            if not re.search(rf"rank {rank} \(local rank {rank}, pid {victim}\) was killed by SIGKILL", output):
                problems.append("the summary does not name the killed rank: " + output[-400:])
        elif kind in ("SIGTERM the launcher", "SIGINT the launcher"):
            sig = signal.SIGTERM if kind.startswith("SIGTERM") else signal.SIGINT
            if code != 128 + sig or stopped > 3:
                problems.append(f"launcher exit {code} after {stopped:.1f} s")
            if f"stopped by {sig.name}" not in output:
                problems.append("no 'stopped by' line: " + output[-400:])
    finally:
        job.kill_everything()
    step, latest_problems = _check_latest(save_dir, last_saved)
    return step, problems + latest_problems, stopped


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=3, help="repetitions of each fault (default %(default)s)")
    parser.add_argument("--seed", type=int, default=None)
    args = parser.parse_args()
    seed = args.seed if args.seed is not None else random.randrange(1 << 30)
    rng = random.Random(seed)
    kinds = ["kill -9 a rank", "kill -9 the launcher", "kill -9 everything (mid-save)", "SIGTERM the launcher",
             "SIGINT the launcher"]
    results = {k: Outcome() for k in [*kinds, "disk full during a save"]}
    mounted_any = False
    with tempfile.TemporaryDirectory(prefix="shardwise-faults-") as root:
        save_dir = Path(root) / "ckpt"
        resume_from = 0
        for trial in range(args.trials):
            for kind in kinds:
                step, problems, seconds = process_fault(kind, save_dir, resume_from, rng)
                results[kind].record(problems, seconds)
                resume_from = step or resume_from
                print(f"trial {trial + 1} {kind}: {'held' if not problems else 'BROKE: ' + '; '.join(problems)} "
                      f"(stopped in {seconds:.2f} s)", flush=True)
            case = Path(root) / f"disk{trial}"
            case.mkdir()
            mounted, outcomes = _run_storage_case(case, full_disk=True)
            mounted_any |= mounted
            problems = []
            for rank, r in enumerate(outcomes):
                error = r["error"] or ""
                if not (error.startswith("SaveFailed: saving t2 failed; 'latest' was not changed")
                        and "No space left on device" in error):
                    problems.append(f"rank {rank}: {error or 'the save passed'}")
                if r["latest"] != "t1" or r["latest_after"] != "t3":
                    problems.append(f"rank {rank}: latest {r['latest']!r} then {r['latest_after']!r}")
            results["disk full during a save"].record(problems)
            print(f"trial {trial + 1} disk full ({'tmpfs' if mounted else 'injected ENOSPC'}): "
                  f"{'held' if not problems else 'BROKE: ' + '; '.join(problems)}", flush=True)

    print(f"\nseed {seed}; disk full on {'a real tmpfs' if mounted_any else 'an injected ENOSPC (not root)'}\n")
    print("| fault | tried | held | time to stop (median, max) |")
    print("|---|---|---|---|")
    for kind, o in results.items():
        times = f"{statistics.median(o.seconds):.2f} s, {max(o.seconds):.2f} s" if o.seconds else "-"
        print(f"| {kind} | {o.tried} | {o.held} | {times} |")
    broken = [f"{k}: {f}" for k, o in results.items() for f in o.failures]
    if broken:
        print("\nbroken promises:\n  " + "\n  ".join(broken))
        sys.exit(1)


if __name__ == "__main__":
    main()
