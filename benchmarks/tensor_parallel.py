"""Tensor parallelism on the reference GPT (shardwise.models.gpt), 4 processes:
tensor 2 x data 2 vs data 4 vs pipe 2 x data 2 — step time and per-rank memory.

    python benchmarks/tensor_parallel.py [--steps 5] [--layers 4] [--hidden 256] [--seq 64] [--rows 8]

Each grid is a fresh ``torchrun`` job of 4 ranks (one intra-op thread each) training the same
model, seed and data with ZeRO-1 over the data axis, fp32, AdamW, ``--rows`` sequences per step in
2 micro-batches. The time is the median step after one warm-up step. Memory per rank: the bytes of
parameters + gradients + optimizer state the rank holds (``engine.memory_breakdown()``), the most
bytes autograd kept for backward at once (``saved_tensors_hooks``), and the process's peak RSS.
The first loss is printed too: it must agree across grids (same model on every grid).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GRIDS = [("tp2 x dp2", 1, 2, 2), ("dp4", 1, 1, 4), ("pp2 x dp2", 2, 1, 2)]  # name, pp, tp, dp


class _Meter:
    live = peak = 0

    @classmethod
    def pack(cls, t):
        n = t.numel() * t.element_size()
        cls.live += n
        cls.peak = max(cls.peak, cls.live)
        return (t, n)

    @classmethod
    def unpack(cls, packed):
        t, n = packed
        cls.live -= n
        return t


def worker(args) -> None:
    import torch

    import shardwise
    from shardwise.models.gpt import GPT, GPTConfig, gpt_pipeline_module
    from shardwise.topology import ParallelGrid, PipeModelDataParallelTopology

    torch.set_num_threads(1)
    shardwise.init_distributed()
    pp, tp, dp = args.pp, args.tp, args.dp
    cfg = GPTConfig(vocab_size=1024, seq_len=args.seq, hidden=args.hidden, n_layers=args.layers, n_heads=8)
    topo = PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=dp)
    ds = {"train_batch_size": args.rows, "gradient_accumulation_steps": 2,
          "train_micro_batch_size_per_gpu": args.rows // 2 // dp,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 1}}
    if pp > 1:
        engine, *_ = shardwise.initialize(model=gpt_pipeline_module(cfg, topology=topo, partition_method="uniform"),
                                          config=ds)
    else:
        grid = ParallelGrid(topo)
        with grid.active():  # the model's tensor-parallel layers shard over this grid
            model = GPT(cfg)
        engine, *_ = shardwise.initialize(model=model, mpu=grid, config=ds)
    grid = engine.grid
    d = grid.get_data_parallel_rank()
    per = args.rows // dp // 2
    times, first_loss = [], None
    for step in range(args.steps + 1):
        g = torch.Generator().manual_seed(step)
        tokens = torch.randint(0, cfg.vocab_size, (args.rows, cfg.seq_len + 1), generator=g)
        x, y = tokens[:, :-1], tokens[:, 1:]
        mine = [(x[(d * 2 + m) * per:(d * 2 + m + 1) * per], y[(d * 2 + m) * per:(d * 2 + m + 1) * per])
                for m in range(2)]
        torch.distributed.barrier()
        t0 = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(_Meter.pack, _Meter.unpack):
            if pp > 1:
                loss = float(engine.train_batch(iter(mine)))
            else:
                total = 0.0
                for xm, ym in mine:
                    out = engine(xm, ym)
                    engine.backward(out)
                    engine.step()
                    total += float(out) / 2
                t = torch.tensor([total / dp])
                torch.distributed.all_reduce(t, group=grid.get_data_parallel_group())
                loss = float(t)
        torch.distributed.barrier()
        if step == 0:
            first_loss = loss
        else:
            times.append(time.perf_counter() - t0)
    state_bytes = engine.memory_breakdown().total
    row = {"rank": torch.distributed.get_rank(), "step_s": statistics.median(times), "first_loss": first_loss,
           "state_mib": state_bytes / 2**20, "act_mib": _Meter.peak / 2**20,
           "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    rows = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(rows, row)
    if torch.distributed.get_rank() == 0:
        print("RESULT " + json.dumps(rows), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--dp", type=int, default=4)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--rows", type=int, default=8)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    results = {}
    for name, pp, tp, dp in GRIDS:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4",
               os.path.abspath(__file__), "--worker", "--pp", str(pp), "--tp", str(tp), "--dp", str(dp),
               "--steps", str(args.steps), "--layers", str(args.layers), "--hidden", str(args.hidden),
               "--seq", str(args.seq), "--rows", str(args.rows)]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
        line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if line is None:
            sys.exit(f"{name} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
        results[name] = json.loads(line[len("RESULT "):])
    base = max(r["step_s"] for r in results["dp4"])
    print(f"GPT hidden {args.hidden}, {args.layers} layers, seq {args.seq}, {args.rows} sequences/step, 4 ranks\n")
    print("| grid | step (s) | vs dp4 | params+grads+optimizer per rank (MiB) | peak saved activations per rank (MiB) "
          "| peak RSS per rank (MiB) | first loss |")
    print("|---|---|---|---|---|---|---|")
    for name, rows in results.items():
        step = max(r["step_s"] for r in rows)
        fmt = lambda key: " / ".join(f"{r[key]:.1f}" for r in rows)  # noqa: E731
        print(f"| {name} | {step:.3f} | {step / base:.2f} | {fmt('state_mib')} | {fmt('act_mib')} | {fmt('rss_mib')} "
              f"| {rows[0]['first_loss']:.5f} |")


if __name__ == "__main__":
    main()
