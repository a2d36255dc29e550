"""Step time of two source trees of shardwise on the same runs: ZeRO 0-3, pipe 2 and tensor 2 (2 ranks).

    python benchmarks/plan_before_after.py --before /path/to/old/tree --after . [--steps 20] [--repeats 3]

Made for changes that must not change speed (refactors): every case runs in
fresh processes with ``PYTHONPATH`` set to one tree, the trees alternate (A B A B ...) so machine
drift hits both, and the table shows the median step time of rank 0 after warm-up per tree and the
ratio after/before. The model is the reference GPT (``shardwise.models.gpt``), fp32, AdamW.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import time

CASES = {
    "ZeRO 0": {"zero": 0}, "ZeRO 1": {"zero": 1}, "ZeRO 2": {"zero": 2}, "ZeRO 3": {"zero": 3},
    "ZeRO 2 dflt": {"zero": 2, "default_bucket": True},  # reduce_bucket_size left to its default
    "pipe 2": {"zero": 1, "pp": 2}, "tensor 2": {"zero": 1, "tp": 2},
}
WORLD, MICRO = 2, 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, case: dict, steps: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD),
                      LOCAL_RANK=str(rank))
    import torch

    torch.set_num_threads(1)
    import shardwise
    from shardwise.models.gpt import GPT, GPTConfig, gpt_pipeline_module
    from shardwise.topology import ParallelGrid, PipeModelDataParallelTopology

    shardwise.init_distributed()
    pp, tp = case.get("pp", 1), case.get("tp", 1)
    dp = WORLD // (pp * tp)
    cfg = GPTConfig(vocab_size=512, seq_len=64, hidden=192, n_layers=4, n_heads=6)
    rows = 4 * dp * MICRO
    ds = {"train_batch_size": rows, "gradient_accumulation_steps": MICRO, "gradient_clipping": 1.0,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
          "zero_optimization": {"stage": case["zero"], "reduce_bucket_size": 2_000_000}}
    if case.get("default_bucket"):
        del ds["zero_optimization"]["reduce_bucket_size"]
    topo = PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=dp)
    if pp > 1:
        engine, *_ = shardwise.initialize(model=gpt_pipeline_module(cfg, topology=topo, partition_method="uniform"),
                                          config=ds)
    else:
        grid = ParallelGrid(topo)
        scope = grid.active() if hasattr(grid, "active") else contextlib.nullcontext()  # the older tree has none
        with scope:
            model = GPT(cfg)
        engine, *_ = shardwise.initialize(model=model, mpu=grid, config=ds)
    d = engine.grid.get_data_parallel_rank()
    per = rows // dp // MICRO
    times = []
    for step in range(steps + 3):
        g = torch.Generator().manual_seed(step)
        tokens = torch.randint(0, cfg.vocab_size, (rows, cfg.seq_len + 1), generator=g)
        x, y = tokens[:, :-1], tokens[:, 1:]
        mine = [(x[(d * MICRO + m) * per:(d * MICRO + m + 1) * per], y[(d * MICRO + m) * per:(d * MICRO + m + 1) * per])
                for m in range(MICRO)]
        torch.distributed.barrier()
        t0 = time.perf_counter()
        if pp > 1:
            engine.train_batch(iter(mine))
        else:
            for xm, ym in mine:
                loss = engine(xm, ym)
                engine.backward(loss)
                engine.step()
        times.append(time.perf_counter() - t0)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"step_s": statistics.median(times[3:])}, f)
    shardwise.comm.destroy_process_group()


def _run(tree: str, name: str, steps: int) -> float:
    out = f"/tmp/plan_bench_{os.getpid()}.json"
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": os.path.abspath(tree), "OMP_NUM_THREADS": "1", "SHARDWISE_LOG_LEVEL": "warning"}
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", str(r), "--case", name,
                               "--steps", str(steps), "--port", str(port), "--out", out],
                              env=env, cwd=os.path.abspath(tree)) for r in range(WORLD)]
    for p in procs:
        if p.wait(timeout=600) != 0:
            raise SystemExit(f"{name} in {tree}: a rank exited with {p.returncode}")
    with open(out) as f:
        return json.load(f)["step_s"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", required=False)
    ap.add_argument("--after", default=".")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cases", nargs="*", default=list(CASES))
    ap.add_argument("--worker", type=int, default=None)
    ap.add_argument("--case", default=None)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    if a.worker is not None:
        _worker(a.worker, CASES[a.case], a.steps, a.port, a.out)
        return
    if not a.before:
        raise SystemExit("--before PATH (a checkout of the older tree) is required")
    got = {name: {"before": [], "after": []} for name in a.cases}
    for _ in range(a.repeats):
        for name in a.cases:
            for which in ("before", "after"):  # A B A B: drift hits both
                got[name][which].append(_run(getattr(a, which), name, a.steps))
    print(f"{'case':<12} {'before ms':>10} {'after ms':>10} {'after/before':>13}")
    for name, r in got.items():
        b, f = statistics.median(r["before"]), statistics.median(r["after"])
        print(f"{name:<12} {b * 1e3:>10.1f} {f * 1e3:>10.1f} {f / b:>13.3f}")


if __name__ == "__main__":
    main()
