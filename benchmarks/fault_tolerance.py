"""Time lost per failure: replica groups on torchft against ``--max_restarts`` from a checkpoint.

    python benchmarks/fault_tolerance.py --kills 3 --steps 300 --replicas 2 --procs 1

Four jobs of the same small regression (a 3-layer MLP, AdamW), each timed from launch to exit:

* ``ft``: ``shardwise run --ft_replicas R`` with the ``fault_tolerance`` block, no failure;
* ``ft+kills``: the same; replica group 1 kill -9s itself N times, each time after it has trained
  M / (N + 1) steps together with the others since it (re)started. It restarts alone and takes a live
  peer's state; the other groups go on (alone, on their own share of the data, while it restarts);
* ``restart``: ``shardwise run --num_procs R*P --max_restarts N`` (one world of the same ranks), a
  checkpoint every ``--ckpt_every`` steps, no failure;
* ``restart+kills``: the same; rank 1 kill -9s itself at steps M/(N+1), 2M/(N+1), ...; every rank
  restarts and resumes from the last checkpoint.

A job ends when its step counter reached M; a job with kills, besides, only once the killed group is
back for the last time and every group trained 3 steps together (so it may run more than M steps).
The work a job did is counted in replica-group steps (one group's batch trained once; steps run again
after a restart count once; a step the killed group missed counts for the groups that took part in it,
and the group-steps it missed are reported). Time lost per failure = (wall time - the fault-free job's
wall time - the extra work / the fault-free job's rate of work) / N: what a failure cost beyond the work
it let the job do. Not part of CI.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TOGETHER_AT_END = 3  # steps every group trains together after the last rejoin, before a job with kills ends


# ------------------------------------------------------------------------------------------ the worker
def worker(a: argparse.Namespace) -> None:
    import torch

    import shardwise
    from shardwise.utils import RepeatingLoader

    replica = int(os.environ.get("REPLICA_GROUP_ID", "0"))
    groups = int(os.environ.get("NUM_REPLICA_GROUPS", "1"))
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    torch.manual_seed(0)
    x = torch.randn(4096, 32)
    data = torch.utils.data.TensorDataset(x, x @ torch.randn(32, 1))
    model = torch.nn.Sequential(torch.nn.Linear(32, a.width), torch.nn.Tanh(), torch.nn.Linear(a.width, a.width),
                                torch.nn.Tanh(), torch.nn.Linear(a.width, 1))
    config = {"train_micro_batch_size_per_gpu": 16, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": a.stage}}
    if a.mode == "ft":
        config["fault_tolerance"] = {"enabled": True, "quorum_timeout": 120, "timeout": 30}
    engine, _, loader, _ = shardwise.initialize(model=model, config=config, training_data=data)
    ft = engine.fault_tolerance
    if a.mode == "restart" and (Path(a.ckpt) / "latest").exists():
        engine.load_checkpoint(a.ckpt)
    gap = max(a.steps // (a.kills + 1), 1)
    out = Path(a.out)
    if a.mode == "ft":
        # replica group 1 dies after `gap` steps trained together in each of its first N attempts
        victim = replica == 1 and engine.global_rank == 0 and attempt < a.kills
        kill_after = gap
        final_marker = out / "final_rejoin"
        if replica == 1 and a.kills and attempt == a.kills and engine.global_rank == 0:
            final_marker.with_suffix(".tmp").write_text(str(engine.global_steps))
            os.replace(final_marker.with_suffix(".tmp"), final_marker)  # from here the groups train together
    else:
        victim = engine.global_rank == 1 and attempt < a.kills
        kill_after = None

    def done(committed: bool, participants: int) -> bool:
        if engine.global_steps < a.steps:
            return False
        if a.mode != "ft" or not a.kills:
            return True
        if not (committed and participants == groups and final_marker.exists()):
            return False
        return engine.global_steps >= int(final_marker.read_text()) + TOGETHER_AT_END

    log = out / f"r{replica}_{engine.global_rank}_a{attempt}.jsonl"
    together = 0
    with open(log, "a") as f:
        it = iter(RepeatingLoader(loader))
        while True:
            xb, yb = next(it)
            step = engine.global_steps
            loss = torch.nn.functional.mse_loss(engine(xb), yb)
            engine.backward(loss)
            if victim and (together >= kill_after if kill_after else step >= gap * (attempt + 1)):
                os.kill(os.getpid(), signal.SIGKILL)
            engine.step()
            committed = engine.global_steps > step
            participants = ft.participants if ft else 1
            together += committed and participants == groups
            f.write(json.dumps({"t": time.time(), "step": step, "committed": committed,
                                "participants": participants}) + "\n")
            f.flush()
            if a.mode == "restart" and committed and engine.global_steps % a.ckpt_every == 0:
                engine.save_checkpoint(a.ckpt)
            if done(committed, participants):
                break


# ------------------------------------------------------------------------------------------ the driver
def _where(out: Path) -> str:
    """What a failed job's processes logged last, and the end of its launcher's output."""
    lines = []
    for f in sorted(out.glob("r*_a*.jsonl")):
        rows = f.read_text().splitlines()
        lines.append(f"{f.name}: {len(rows)} steps, last {rows[-1] if rows else None}")
    return "\n".join([*lines, "the end of its log:", (out / "launch.log").read_text()[-2000:]])


def run_job(a, mode: str, kills: int, root: Path) -> dict:
    out = root / f"{mode}-{kills}"
    out.mkdir(parents=True)
    wargs = [__file__, "--worker", "--mode", mode, "--out", str(out), "--ckpt", str(out / "ckpt"), "--steps",
             str(a.steps), "--kills", str(kills), "--ckpt_every", str(a.ckpt_every), "--stage", str(a.stage),
             "--width", str(a.width)]
    if mode == "ft":
        launch = ["--ft_replicas", str(a.replicas), "--num_procs", str(a.procs), "--max_restarts", str(kills),
                  "--ft_join_timeout", "1", "--ft_heartbeat_timeout", "2"]
    else:
        launch = ["--num_procs", str(a.replicas * a.procs), "--max_restarts", str(kills)]
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", RUST_LOG="warn")
    t0 = time.perf_counter()
    with open(out / "launch.log", "w") as log:
        job = subprocess.Popen([sys.executable, "-m", "shardwise", "run", *launch, *wargs], env=env, cwd=out,
                               stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = job.wait(timeout=a.job_timeout)
        except subprocess.TimeoutExpired:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
            raise SystemExit(f"{mode} with {kills} kill(s) did not end within --job_timeout {a.job_timeout}s\n"
                             f"{_where(out)}")
    wall = time.perf_counter() - t0
    if rc != 0:
        raise SystemExit(f"{mode} with {kills} kill(s) failed (exit {rc})\n{_where(out)}")
    rows = [json.loads(line) for f in sorted(out.glob("r0_0_a*.jsonl")) for line in f.read_text().splitlines()]
    done = {r["step"]: r for r in rows if r["committed"]}  # steps run again after a restart count once
    committed = len(done)
    # the work done, in replica-group steps (one group's batch trained once): a step the killed group
    # missed counts for the groups that took part in it
    work = sum(r["participants"] for r in done.values()) if mode == "ft" else committed * a.replicas
    discarded = sum(not r["committed"] for r in rows)
    rerun = sum(r["committed"] for r in rows) - committed  # steps trained again after a restart
    return {"wall": wall, "committed": committed, "discarded": discarded, "rerun": rerun, "work": work,
            "group_steps_missed": committed * a.replicas - work, "span": rows[-1]["t"] - rows[0]["t"] if rows else 0.0}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kills", type=int, default=3)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--procs", type=int, default=1)
    p.add_argument("--stage", type=int, default=1)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--ckpt_every", type=int, default=None, help="default: steps / 6")
    p.add_argument("--job_timeout", type=float, default=600, help="seconds one job may take before it is killed")
    p.add_argument("--worker", action="store_true")
    p.add_argument("--mode", choices=["ft", "restart"])
    p.add_argument("--out")
    p.add_argument("--ckpt")
    p.add_argument("--local_rank", type=int, default=0)
    a = p.parse_args()
    if a.ckpt_every is None:
        a.ckpt_every = max(a.steps // 6, 1)
    if a.worker:
        return worker(a)
    if a.kills < 1 or a.steps < a.kills + 1:
        raise SystemExit("--kills must be at least 1 and --steps at least --kills + 1")
    with tempfile.TemporaryDirectory(prefix="ft-bench-") as tmp:
        root = Path(tmp)
        print(f"{a.kills} kill(s) during {a.steps} steps; {a.replicas} replica group(s) x {a.procs} process(es), "
              f"ZeRO-{a.stage}, MLP width {a.width}; checkpoint every {a.ckpt_every} steps for --max_restarts",
              flush=True)
        print("| job | wall s | committed steps | discarded steps | steps run again | group-steps missed | "
              "lost per failure s |")
        print("|---|---|---|---|---|---|---|", flush=True)
        lost = {}
        for mode in ("ft", "restart"):
            free = run_job(a, mode, 0, root)
            rate = free["work"] * (free["committed"] - 1) / free["committed"] / max(free["span"], 1e-9)
            hit = run_job(a, mode, a.kills, root)
            # wall time beyond the fault-free job's, less the time the extra work took at its rate
            lost[mode] = (hit["wall"] - free["wall"] - (hit["work"] - free["work"]) / rate) / a.kills
            name = "fault tolerance (torchft)" if mode == "ft" else "--max_restarts + checkpoint"
            for label, r, l in ((f"{name}, no failure", free, "-"),
                                (f"{name}, {a.kills} kill(s)", hit, f"{lost[mode]:.2f}")):
                print(f"| {label} | {r['wall']:.1f} | {r['committed']} | {r['discarded']} | {r['rerun']} | "
                      f"{r['group_steps_missed']} | {l} |", flush=True)
        ratio = (f"{lost['restart'] / lost['ft']:.1f}x" if lost["ft"] > 0 else
                 "fault tolerance lost no time beyond the work it did, so no ratio")
        print(f"\ntime lost per failure: {lost['ft']:.2f} s with fault tolerance, {lost['restart']:.2f} s with "
              f"--max_restarts from a checkpoint: {ratio}")


if __name__ == "__main__":
    main()
