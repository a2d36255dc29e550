"""Time lost per failure: replica groups on torchft against ``--max_restarts`` from a checkpoint.

    python benchmarks/fault_tolerance.py --kills 3 --steps 300 --replicas 2 --procs 1

Four jobs of the same small regression (a 3-layer MLP, AdamW), each timed from launch to exit:

* ``ft``: ``shardwise run --ft_replicas R`` with the ``fault_tolerance`` block, no failure;
* ``ft+kills``: the same, replica group 1 kill -9s itself N times (at evenly spaced steps); it restarts
  alone and takes a live peer's state, the other groups go on;
* ``restart``: ``shardwise run --num_procs R*P --max_restarts N`` (one world of the same ranks), a
  checkpoint every ``--ckpt_every`` steps, no failure;
* ``restart+kills``: the same, rank 1 kill -9s itself N times; every rank restarts and resumes from
  the last checkpoint.

Time lost per failure = (wall time - distinct committed steps x the fault-free job's time per step, less
the same for the fault-free job: start-up) / N; steps run again after a restart count once. For
fault tolerance it also reports the samples not trained on (discarded steps, and steps a group missed).
Smoke run: ``--kills 1 --steps 30``. Not part of CI.
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


# ------------------------------------------------------------------------------------------ the worker
def worker(a: argparse.Namespace) -> None:
    import torch

    import shardwise
    from shardwise.utils import RepeatingLoader

    replica = int(os.environ.get("REPLICA_GROUP_ID", "0"))
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    torch.manual_seed(0)
    x = torch.randn(4096, 32)
    data = torch.utils.data.TensorDataset(x, x @ torch.randn(32, 1))
    model = torch.nn.Sequential(torch.nn.Linear(32, a.width), torch.nn.Tanh(), torch.nn.Linear(a.width, a.width),
                                torch.nn.Tanh(), torch.nn.Linear(a.width, 1))
    config = {"train_micro_batch_size_per_gpu": 16, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": a.stage}}
    if a.mode == "ft":
        config["fault_tolerance"] = {"enabled": True, "quorum_timeout": 120}
    engine, _, loader, _ = shardwise.initialize(model=model, config=config, training_data=data)
    ft = engine.fault_tolerance
    if a.mode == "restart" and (Path(a.ckpt) / "latest").exists():
        engine.load_checkpoint(a.ckpt)
    kills = [a.steps * (i + 1) // (a.kills + 1) for i in range(a.kills)]
    victim = (replica == 1 and engine.global_rank == 0) if a.mode == "ft" else engine.global_rank == 1
    groups = int(os.environ.get("NUM_REPLICA_GROUPS", "1"))
    log = Path(a.out) / f"r{replica}_{engine.global_rank}_a{attempt}.jsonl"
    with open(log, "a") as f:
        it = iter(RepeatingLoader(loader))
        while engine.global_steps < a.steps or (ft is not None and a.kills and ft.participants < groups):
            xb, yb = next(it)
            step = engine.global_steps
            loss = torch.nn.functional.mse_loss(engine(xb), yb)
            engine.backward(loss)
            if victim and attempt < len(kills) and step >= kills[attempt]:
                os.kill(os.getpid(), signal.SIGKILL)
            engine.step()
            f.write(json.dumps({"t": time.time(), "step": step, "committed": engine.global_steps > step,
                                "participants": ft.participants if ft else 1}) + "\n")
            f.flush()
            if a.mode == "restart" and engine.global_steps % a.ckpt_every == 0 and engine.global_steps > step:
                engine.save_checkpoint(a.ckpt)


# ------------------------------------------------------------------------------------------ the driver
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
    rc = subprocess.run([sys.executable, "-m", "shardwise", "run", *launch, *wargs], env=env, cwd=out,
                        stdout=open(out / "launch.log", "w"), stderr=subprocess.STDOUT).returncode
    wall = time.perf_counter() - t0
    if rc != 0:
        raise SystemExit(f"{mode} with {kills} kill(s) failed (exit {rc}); see {out / 'launch.log'}")
    rows = [json.loads(line) for f in sorted(out.glob("r0_0_a*.jsonl")) for line in f.read_text().splitlines()]
    committed = len({r["step"] for r in rows if r["committed"]})  # steps run again after a restart count once
    missed = sum(a.replicas - r["participants"] for r in rows if r["committed"]) if mode == "ft" else 0
    discarded = sum(not r["committed"] for r in rows)
    return {"wall": wall, "committed": committed, "discarded": discarded, "group_steps_missed": missed,
            "first": rows[0]["t"] if rows else None, "last": rows[-1]["t"] if rows else None}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kills", type=int, default=3)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--procs", type=int, default=1)
    p.add_argument("--stage", type=int, default=1)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--ckpt_every", type=int, default=50)
    p.add_argument("--worker", action="store_true")
    p.add_argument("--mode", choices=["ft", "restart"])
    p.add_argument("--out")
    p.add_argument("--ckpt")
    p.add_argument("--local_rank", type=int, default=0)
    a = p.parse_args()
    if a.worker:
        return worker(a)
    with tempfile.TemporaryDirectory(prefix="ft-bench-") as tmp:
        root = Path(tmp)
        print(f"{a.kills} kill(s) during {a.steps} steps; {a.replicas} replica group(s) x {a.procs} process(es), "
              f"ZeRO-{a.stage}; checkpoint every {a.ckpt_every} steps for --max_restarts")
        print(f"| job | wall s | committed steps | discarded steps | group-steps missed | lost per failure s |")
        print("|---|---|---|---|---|---|")
        for mode in ("ft", "restart"):
            free = run_job(a, mode, 0, root)
            per_step = (free["last"] - free["first"]) / max(free["committed"] - 1, 1)
            hit = run_job(a, mode, a.kills, root)
            lost = (hit["wall"] - hit["committed"] * per_step - (free["wall"] - free["committed"] * per_step)) / max(a.kills, 1)
            name = "fault tolerance (torchft)" if mode == "ft" else "--max_restarts + checkpoint"
            for label, r, l in ((f"{name}, no failure", free, "-"), (f"{name}, {a.kills} kill(s)", hit, f"{lost:.1f}")):
                print(f"| {label} | {r['wall']:.1f} | {r['committed']} | {r['discarded']} | {r['group_steps_missed']} | {l} |")


if __name__ == "__main__":
    main()
