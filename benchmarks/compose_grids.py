"""Composed parallel grids on the reference GPT (shardwise.models.gpt): step time and model-state memory
per rank, the longest sequence under a memory cap, and a 4D run checked against one process.

    python benchmarks/compose_grids.py                      # the table: 8 processes per grid
    python benchmarks/compose_grids.py --longest --cap-mib 64   # sp 2 x dp 2 vs sp 2 x tp 2, 4 processes
    python benchmarks/compose_grids.py --four-d              # dp 2 x pipe 2 x tensor 2 x sequence 2, 16 processes

Table (8 ranks): dp 8 ZeRO-3, tp 2 x dp 4 ZeRO-3, pp 2 x tp 2 x dp 2 ZeRO-3, pp 2 x tp 2 x sp 2 ZeRO-1. Each
grid is a fresh ``torchrun`` job (one intra-op thread per rank) training the same model, seed and data
(fp32, AdamW, ``--rows`` sequences per step in 2 micro-batches); grids run in ``--rounds`` rounds, the
order reversed every other round (A B C D, D C B A, ...), and a grid's step time is the median over
rounds of its slowest rank's median step (after one warm-up step). Model states per rank: what
``engine.memory_breakdown()`` counts (parameters, gradients, optimizer states); activations: the most
bytes autograd kept for backward at once (``saved_tensors_hooks``). The first loss must agree across
grids (the same model everywhere).

``--longest``: for sp 2 x dp 2 and sp 2 x tp 2 (4 ranks, ZeRO-1), the sequence length doubles from
``--seq`` while model states + saved activations of the most loaded rank stay under ``--cap-mib``.

``--four-d``: 16 ranks, every axis 2 (ZeRO ``--zero``, default 1), SGD with momentum; prints each step's
loss next to one process training the same model on the whole batch, and exits 1 if any differs by more
than 1e-5 (relative).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from tensor_parallel import _Meter  # noqa: E402  (the saved-activation meter of the 3D benchmark)
GRIDS = [  # name, pp, tp, sp, dp, ZeRO stage
    ("dp8 Z3", 1, 1, 1, 8, 3),
    ("tp2 x dp4 Z3", 1, 2, 1, 4, 3),
    ("pp2 x tp2 x dp2 Z3", 2, 2, 1, 2, 3),
    ("pp2 x tp2 x sp2 Z1", 2, 2, 2, 1, 1),
]
LONGEST = [("sp2 x dp2", 1, 1, 2, 2, 1), ("sp2 x tp2", 1, 2, 2, 1, 1)]
FOUR_D = ("dp2 x pp2 x tp2 x sp2", 2, 2, 2, 2)  # name, pp, tp, sp, dp
LR, SGD_LR = 1e-3, 0.1


def gpt_config(args):
    from shardwise.models.gpt import GPTConfig

    return GPTConfig(vocab_size=args.vocab, seq_len=args.seq, hidden=args.hidden, n_layers=args.layers,
                     n_heads=args.heads)


def batch(step: int, args):
    import torch

    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, args.vocab, (args.rows, args.seq + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def reference_losses(args) -> list[float]:
    """One process, the whole batch, the same model, optimizer and micro-batches."""
    import torch

    from shardwise.models.gpt import GPT

    torch.set_num_threads(1)
    model = GPT(gpt_config(args))
    opt = torch.optim.SGD(model.parameters(), lr=SGD_LR, momentum=0.9) if args.optim == "sgd" else \
        torch.optim.AdamW(model.parameters(), lr=LR)
    half = args.rows // 2
    losses = []
    for step in range(args.steps + 1):
        x, y = batch(step, args)
        total = 0.0
        for m in range(2):
            loss = model(x[m * half:(m + 1) * half], y[m * half:(m + 1) * half]) / 2
            loss.backward()
            total += float(loss.detach())
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses


def _engine(args):
    import shardwise
    from shardwise.models.gpt import GPT, gpt_pipeline_module
    from shardwise.parallel_dims import ParallelDims
    from shardwise.topology import ParallelGrid, ProcessTopology

    pp, tp, sp, dp = args.pp, args.tp, args.sp, args.dp
    cfg = gpt_config(args)
    topo = ProcessTopology.from_dims(ParallelDims(data=dp, pipe=pp, tensor=tp, sequence=sp))
    ds = {"train_batch_size": args.rows, "gradient_accumulation_steps": 2,
          "train_micro_batch_size_per_gpu": args.rows // 2 // dp, "steps_per_print": 10**9,
          "optimizer": {"type": "SGD", "params": {"lr": SGD_LR, "momentum": 0.9}} if args.optim == "sgd" else
                       {"type": "AdamW", "params": {"lr": LR}},
          "zero_optimization": {"stage": args.zero, "stage3_param_persistence_threshold": 0}}
    if pp > 1:
        model = gpt_pipeline_module(cfg, topology=topo, partition_method="uniform")
        return shardwise.initialize(model=model, config=ds)[0]
    grid = ParallelGrid(topo)
    with grid.active():  # the tensor-parallel layers cut themselves over this grid
        model = GPT(cfg)
    return shardwise.initialize(model=model, mpu=grid, config=ds)[0]


def worker(args) -> None:
    import torch

    import shardwise

    torch.set_num_threads(1)
    shardwise.init_distributed()
    engine = _engine(args)
    grid = engine.grid
    d, s = grid.get_data_parallel_rank(), grid.get_sequence_parallel_rank()
    per, cut = args.rows // args.dp // 2, args.seq // args.sp  # this data rank's rows, sequence rank's tokens
    times, losses = [], []
    for step in range(args.steps + 1):
        x, y = (t[:, s * cut:(s + 1) * cut] for t in batch(step, args))
        mine = [(x[(d * 2 + m) * per:(d * 2 + m + 1) * per], y[(d * 2 + m) * per:(d * 2 + m + 1) * per])
                for m in range(2)]
        torch.distributed.barrier()
        t0 = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(_Meter.pack, _Meter.unpack):
            if args.pp > 1:
                loss = float(engine.train_batch(iter(mine)))
            else:
                total = torch.zeros(())
                for xm, ym in mine:
                    out = engine(xm, ym)
                    engine.backward(out)
                    engine.step()
                    total += out.detach() / 2 / args.dp
                torch.distributed.all_reduce(total, group=grid.get_data_parallel_group())
                loss = float(total)
        torch.distributed.barrier()
        losses.append(loss)
        if step:
            times.append(time.perf_counter() - t0)
    row = {"rank": torch.distributed.get_rank(), "step_s": statistics.median(times) if times else 0.0,
           "losses": losses, "state_mib": engine.memory_breakdown().total / 2**20, "act_mib": _Meter.peak / 2**20}
    rows = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(rows, row)
    if torch.distributed.get_rank() == 0:
        print("RESULT " + json.dumps(rows), flush=True)


def launch(args, *, pp, tp, sp, dp, zero, seq=None, steps=None) -> list[dict]:
    world = pp * tp * sp * dp
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(world),
           os.path.abspath(__file__), "--worker", "--pp", str(pp), "--tp", str(tp), "--sp", str(sp), "--dp", str(dp),
           "--zero", str(zero), "--steps", str(steps if steps is not None else args.steps),
           "--layers", str(args.layers), "--hidden", str(args.hidden), "--heads", str(args.heads),
           "--seq", str(seq or args.seq), "--rows", str(args.rows), "--vocab", str(args.vocab), "--optim", args.optim]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        sys.exit(f"pp {pp} tp {tp} sp {sp} dp {dp} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return json.loads(line[len("RESULT "):])


def table(args) -> None:
    runs: dict[str, list] = {name: [] for name, *_ in GRIDS}
    for r in range(args.rounds):
        for name, pp, tp, sp, dp, zero in (GRIDS if r % 2 == 0 else GRIDS[::-1]):
            runs[name].append(launch(args, pp=pp, tp=tp, sp=sp, dp=dp, zero=zero))
    step = {name: statistics.median(max(row["step_s"] for row in rows) for rows in rs) for name, rs in runs.items()}
    base = step[GRIDS[0][0]]
    print(f"GPT hidden {args.hidden}, {args.layers} layers, {args.heads} heads, seq {args.seq}, {args.rows} sequences "
          f"per step, 8 ranks, {args.rounds} rounds\n")
    print("| grid | step (s) | vs dp8 Z3 | model states per rank (MiB, max) | saved activations per rank (MiB, max) "
          "| first loss |")
    print("|---|---|---|---|---|---|")
    for name, rs in runs.items():
        rows = rs[-1]
        print(f"| {name} | {step[name]:.3f} | {step[name] / base:.2f} | {max(r['state_mib'] for r in rows):.2f} "
              f"| {max(r['act_mib'] for r in rows):.2f} | {rows[0]['losses'][0]:.5f} |")


def longest(args) -> None:
    print(f"GPT hidden {args.hidden}, {args.layers} layers, {args.heads} heads, {args.rows} sequences per step, "
          f"4 ranks, cap {args.cap_mib} MiB of model states + saved activations per rank\n")
    print("| grid | longest sequence under the cap | its model states + activations per rank (MiB, max) |")
    print("|---|---|---|")
    for name, pp, tp, sp, dp, zero in LONGEST:
        seq, best = args.seq, None
        while seq <= args.max_seq:
            rows = launch(args, pp=pp, tp=tp, sp=sp, dp=dp, zero=zero, seq=seq, steps=0)
            used = max(r["state_mib"] + r["act_mib"] for r in rows)
            if used > args.cap_mib:
                break
            best = (seq, used)
            seq *= 2
        print(f"| {name} | {best[0] if best else 'none'} | {best[1]:.1f} |" if best else f"| {name} | none | - |")


def four_d(args) -> None:
    name, pp, tp, sp, dp = FOUR_D
    rows = launch(args, pp=pp, tp=tp, sp=sp, dp=dp, zero=args.zero)
    want = reference_losses(args)
    worst = 0.0
    print(f"{name} (16 ranks, ZeRO {args.zero}) vs one process: GPT hidden {args.hidden}, {args.layers} layers, "
          f"{args.heads} heads, seq {args.seq}, {args.rows} sequences per step\n")
    print("| step | 16 ranks | one process | relative difference |")
    print("|---|---|---|---|")
    for step, (got, ref) in enumerate(zip(rows[0]["losses"], want)):
        rel = abs(got - ref) / abs(ref)
        worst = max(worst, rel, *(abs(r["losses"][step] - ref) / abs(ref) for r in rows))
        print(f"| {step} | {got:.7f} | {ref:.7f} | {rel:.1e} |")
    print(f"\nlargest relative difference over every rank and step: {worst:.1e}")
    sys.exit(0 if worst <= 1e-5 else 1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--longest", action="store_true", help="longest sequence under --cap-mib: sp2 x dp2 vs sp2 x tp2")
    ap.add_argument("--four-d", action="store_true", help="16 ranks, every axis 2, losses against one process")
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--sp", type=int, default=1)
    ap.add_argument("--dp", type=int, default=8)
    ap.add_argument("--zero", type=int, default=1)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--optim", choices=("adamw", "sgd"), help="default: adamw; sgd (momentum 0.9) with --four-d, "
                    "whose update shows a wrong gradient scale that Adam's would hide")
    ap.add_argument("--cap-mib", type=float, default=512.0)
    ap.add_argument("--max-seq", type=int, default=1 << 16)
    args = ap.parse_args()
    args.optim = args.optim or ("sgd" if args.four_d else "adamw")
    if args.worker:
        worker(args)
    elif args.longest:
        longest(args)
    elif args.four_d:
        four_d(args)
    else:
        table(args)


if __name__ == "__main__":
    main()
