"""Convergence of the 1-bit optimizers against their full-precision baselines.

    python benchmarks/onebit_convergence.py [--steps 80] [--freeze 10] [--lr 2e-3] [--seeds 0 1 2]

2 ranks (gloo, spawned here), an MLP 64-512-256-8 fitting a random teacher of the same shape, 32
samples per rank per step, MSE. Each optimizer trains from the same weights on the same data; the
table gives the final loss (the mean of the last 5 steps' losses, averaged over both ranks) and its
ratio to the baseline (OneBitAdam / Adam, OneBitLamb / Lamb), per seed and the geometric mean.
Not a timing benchmark: fine on a loaded machine.

Variants (``name:variant``): ``ds`` is ``bias_correction: false`` (DeepSpeed's own formulas, for
Lamb and OneBitLamb). OneBitLamb's ``rawcoeff`` / ``rawfresh`` each undo one of the two corrections
shardwise makes after warm-up with ``bias_correction: true`` (the trust-ratio average's start from 0,
the fresh variance's; docs/onebit.md), ``old`` undoes both, and
``nofactor`` holds the variance factor at 1 (the frozen trust-ratio average alone).
"""

from __future__ import annotations

import argparse
import math
import os
import socket
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNS = ("Adam", "OneBitAdam", "Lamb", "OneBitLamb", "Lamb:ds", "OneBitLamb:ds", "OneBitLamb:old",
        "OneBitLamb:rawcoeff", "OneBitLamb:rawfresh", "OneBitLamb:nofactor")
BASELINE = {"OneBitAdam": "Adam", "OneBitLamb": "Lamb", "OneBitLamb:ds": "Lamb:ds"}
MICRO, SIZES = 32, (64, 512, 256, 8)


def _mlp(seed: int):
    import torch

    torch.manual_seed(seed)
    layers = []
    for i, (a, b) in enumerate(zip(SIZES, SIZES[1:])):
        layers += [torch.nn.Linear(a, b)] + ([torch.nn.Tanh()] if i < len(SIZES) - 2 else [])
    return torch.nn.Sequential(*layers)


def _worker(rank: int, port: int, run: str, args, out) -> None:
    import torch

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2")
    torch.set_num_threads(1)
    sys.path.insert(0, ROOT)
    import shardwise
    from shardwise.optim.onebit import lamb as onebit_lamb

    name, _, variant = run.partition(":")
    params = {"lr": args.lr}
    if name.startswith("OneBit"):
        params["freeze_step"] = args.freeze
    if variant == "ds":
        params["bias_correction"] = False
    switches = {"nofactor": ["_hold_factor"], "rawcoeff": ["_raw_coeff_average"],
                "rawfresh": ["_raw_fresh_variance"], "old": ["_raw_coeff_average", "_raw_fresh_variance"]}
    for attr in switches.get(variant, []):
        setattr(onebit_lamb.OneBitLamb, attr, True)
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_clipping": 0.0,
           "optimizer": {"type": name, "params": params}}
    engine, *_ = shardwise.initialize(model=_mlp(100 + args.seed), config=cfg)
    teacher = _mlp(200 + args.seed)
    g = torch.Generator().manual_seed(1000 * args.seed + rank)
    losses = []
    for _ in range(args.steps):
        x = torch.randn(MICRO, SIZES[0], generator=g)
        with torch.no_grad():
            y = teacher(x)
        loss = ((engine(x) - y) ** 2).mean()
        engine.backward(loss)
        engine.step()
        t = loss.detach().clone()
        torch.distributed.all_reduce(t)
        losses.append(t.item() / 2)
    if rank == 0:
        out.put(losses)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def _run(run: str, args) -> list[float]:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, port, run, args, out)) for r in range(2)]
    for p in procs:
        p.start()
    losses = out.get(timeout=600)
    for p in procs:
        p.join(timeout=60)
        if p.exitcode != 0:
            raise RuntimeError(f"{run}: a rank exited with {p.exitcode}")
    return losses


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--freeze", type=int, default=10)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--runs", nargs="+", default=list(RUNS))
    args = ap.parse_args()
    finals: dict[str, list[float]] = {}
    for seed in args.seeds:
        args.seed = seed
        for run in args.runs:
            losses = _run(run, args)
            finals.setdefault(run, []).append(sum(losses[-5:]) / 5)
    print(f"final loss (mean of the last 5 of {args.steps} steps), 2 ranks, lr {args.lr}, freeze_step {args.freeze}")
    print(f"{'optimizer':24} " + " ".join(f"seed {s:<8}" for s in args.seeds) + "  vs baseline (geo. mean)")
    for run, vals in finals.items():
        base = BASELINE.get(run, BASELINE.get(run.partition(":")[0]))
        ratio = ""
        if base in finals:
            r = [v / b for v, b in zip(vals, finals[base])]
            ratio = f"{math.exp(sum(map(math.log, r)) / len(r)):.2f}x {base} (" + ", ".join(f"{x:.2f}" for x in r) + ")"
        print(f"{run:24} " + " ".join(f"{v:<13.5f}" for v in vals) + "  " + ratio)


if __name__ == "__main__":
    main()
