"""Optimizer step time and memory traffic on N fp32 parameters (default 25M), one process.

    python benchmarks/optimizer_step.py [--numel 25000000] [--threads 1] [--rounds 3] [--steps 5] \
        [--dsvenv /work/dsvenv] [--json out.json]

For each optimizer it times ``step()`` (median of ``--steps`` steps after one warm-up step,
and the best of ``--rounds`` rounds; the candidates take turns in every round so a load from
other jobs hits all of them alike) and reports:

- ms/step;
- GB/s: the bytes an update must move at least (each input tensor read once, each output
  written once, e.g. 7 x 4 bytes per parameter for Adam: read p, g, m, v; write p, m, v),
  divided by the step time;
- % of bound: the time a plain copy of the same number of bytes takes (half read, half
  written; the faster of torch's ``copy_`` and ``numpy.copyto``), divided by the step time:
  100% means the step moves its bytes as fast as a copy does;
- vs DeepSpeedCPUAdam: the step time relative to DeepSpeed's AVX C++ CPU Adam, run from
  ``--dsvenv`` in a subprocess (its cpu_adam op is JIT-built with ninja the first time: give
  it minutes) in each round, when DeepSpeed is importable there.

Candidates: the optimizers built from the config (``build_optimizer``: torch's fused kernels
for Adam/AdamW/SGD/Adagrad, our chunked Lion/Lamb), ``shardwise.ops.adam.DeepSpeedCPUAdam``,
and torch's ``foreach`` and ``fused`` implementations for comparison.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import textwrap
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from shardwise.optim import Lamb, Lion, build_optimizer  # noqa: E402
from shardwise.ops.adam import DeepSpeedCPUAdam  # noqa: E402

# (label, words moved per parameter, factory)
ADAM_HP = {"lr": 1e-3, "weight_decay": 0.01}


def _candidates():
    return [
        ("config AdamW (torch fused)", 7, lambda ps: build_optimizer("AdamW", ADAM_HP, ps)),
        ("torch AdamW foreach", 7, lambda ps: torch.optim.AdamW(ps, **ADAM_HP, foreach=True)),
        ("torch AdamW fused", 7, lambda ps: torch.optim.AdamW(ps, **ADAM_HP, fused=True)),
        ("shardwise.ops DeepSpeedCPUAdam", 7, lambda ps: DeepSpeedCPUAdam(ps, **ADAM_HP)),
        ("config Adam, adam_w_mode false", 7, lambda ps: build_optimizer("Adam", {**ADAM_HP, "adam_w_mode": False}, ps)),
        ("config SGD momentum", 5, lambda ps: build_optimizer("SGD", {"lr": 0.01, "momentum": 0.9}, ps)),
        ("torch SGD momentum foreach", 5, lambda ps: torch.optim.SGD(ps, lr=0.01, momentum=0.9, foreach=True)),
        ("config Adagrad", 5, lambda ps: build_optimizer("Adagrad", {"lr": 0.01}, ps)),
        ("torch Adagrad foreach", 5, lambda ps: torch.optim.Adagrad(ps, lr=0.01, foreach=True)),
        ("config Lion (chunked)", 5, lambda ps: build_optimizer("Lion", {"lr": 1e-4, "weight_decay": 0.01}, ps)),
        ("Lion foreach", 5, lambda ps: Lion(ps, lr=1e-4, weight_decay=0.01, foreach=True)),
        ("config Lamb (chunked)", 7, lambda ps: build_optimizer("Lamb", {"lr": 1e-3, "weight_decay": 0.01}, ps)),
        ("Lamb foreach", 7, lambda ps: Lamb(ps, lr=1e-3, weight_decay=0.01, foreach=True)),
    ]


def _params(numel: int) -> list[torch.Tensor]:
    """A model-like mix of tensor sizes: 24 blocks of (4 x 1M + 2 small) plus one remainder."""
    sizes, left = [], numel
    while left > 0:
        for n in (1 << 20, 1 << 20, 1 << 20, 1 << 20, 1024, 4096):
            n = min(n, left)
            if n:
                sizes.append(n)
            left -= n
    ps = [torch.randn(n).requires_grad_() for n in sizes]
    for p in ps:
        p.grad = torch.randn_like(p)
    return ps


def _time_steps(opt, steps: int) -> float:
    opt.step()  # warm-up: creates the states
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _copy_time(nbytes: int, steps: int) -> float:
    """A plain copy moving ``nbytes`` (half read, half written): the faster of torch's ``copy_``
    and ``numpy.copyto`` (glibc's memcpy, which streams large copies past the cache)."""
    import numpy as np

    n = nbytes // 8  # fp32 elements per side
    src, dst = torch.randn(n), torch.empty(n)
    ways = [lambda: dst.copy_(src), lambda: np.copyto(dst.numpy(), src.numpy())]
    best = float("inf")
    for way in ways:
        way()
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            way()
            times.append(time.perf_counter() - t0)
        best = min(best, statistics.median(times))
    return best


DS_SCRIPT = textwrap.dedent("""
    import statistics, sys, time, torch
    numel, steps, threads = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    torch.set_num_threads(threads)
    from deepspeed.ops.adam import DeepSpeedCPUAdam
    sizes, left = [], numel
    while left > 0:
        for n in (1 << 20, 1 << 20, 1 << 20, 1 << 20, 1024, 4096):
            n = min(n, left)
            if n:
                sizes.append(n)
            left -= n
    ps = [torch.randn(n).requires_grad_() for n in sizes]
    for p in ps:
        p.grad = torch.randn_like(p)
    opt = DeepSpeedCPUAdam(ps, lr=1e-3, weight_decay=0.01)
    opt.step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter(); opt.step(); times.append(time.perf_counter() - t0)
    print("DS_STEP_SECONDS", statistics.median(times))
""")


def _deepspeed_time(dsvenv: str, numel: int, steps: int, threads: int, timeout: float) -> float | None:
    python = os.path.join(dsvenv, "bin", "python")
    if not os.path.exists(python):
        return None
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": str(threads)}
    env.pop("PYTHONPATH", None)
    proc = subprocess.run([python, "-c", DS_SCRIPT, str(numel), str(steps), str(threads)], env=env,
                          capture_output=True, text=True, timeout=timeout)
    for line in proc.stdout.splitlines():
        if line.startswith("DS_STEP_SECONDS"):
            return float(line.split()[1])
    print(f"(DeepSpeedCPUAdam not measured: exit {proc.returncode}: {proc.stderr.strip()[-400:]})")
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--numel", type=int, default=25_000_000)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--dsvenv", default="/work/dsvenv")
    ap.add_argument("--only", default=None, help="comma-separated substrings of the candidate labels to run")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cands = _candidates()
    if args.only:
        keys = [k.strip().lower() for k in args.only.split(",")]
        cands = [c for c in cands if any(k in c[0].lower() for k in keys)]

    print(f"{args.numel / 1e6:.0f}M fp32 parameters, {args.threads} thread(s), torch {torch.__version__}; "
          "building DeepSpeed's cpu_adam op if needed ...", flush=True)
    ds_ok = _deepspeed_time(args.dsvenv, 1000, 1, args.threads, timeout=1800) is not None

    best: dict[str, float] = {}
    ds_times: list[float] = []
    copy_times: dict[int, float] = {}
    for r in range(args.rounds):
        for label, words, make in cands:
            ps = _params(args.numel)
            opt = make(ps)
            t = _time_steps(opt, args.steps)
            best[label] = min(best.get(label, float("inf")), t)
            del opt, ps
            nbytes = words * 4 * args.numel
            copy_times[nbytes] = min(copy_times.get(nbytes, float("inf")), _copy_time(nbytes, args.steps))
        if ds_ok:
            t = _deepspeed_time(args.dsvenv, args.numel, args.steps, args.threads, timeout=900)
            if t is not None:
                ds_times.append(t)
        print(f"round {r + 1}/{args.rounds} done", flush=True)

    ds = min(ds_times) if ds_times else None
    rows = []
    print("\n| optimizer | ms/step | GB/s | % of copy bound | vs DeepSpeedCPUAdam |")
    print("|---|---|---|---|---|")
    for label, words, _ in cands:
        nbytes = words * 4 * args.numel
        t = best[label]
        row = {"optimizer": label, "ms": t * 1e3, "gbps": nbytes / t / 1e9, "bound": copy_times[nbytes] / t,
               "vs_ds": t / ds if ds else None}
        rows.append(row)
        vs = f"{row['vs_ds']:.2f}x" if ds else "n/a"
        print(f"| {label} | {row['ms']:.1f} | {row['gbps']:.1f} | {100 * row['bound']:.0f}% | {vs} |")
    if ds:
        nbytes = 7 * 4 * args.numel
        print(f"| DeepSpeed 0.19 DeepSpeedCPUAdam (subprocess) | {ds * 1e3:.1f} | {nbytes / ds / 1e9:.1f} | "
              f"{100 * copy_times[nbytes] / ds:.0f}% | 1.00x |")
    for nbytes, t in sorted(copy_times.items()):
        print(f"copy of {nbytes / 1e9:.2f} GB: {t * 1e3:.1f} ms ({nbytes / t / 1e9:.1f} GB/s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"numel": args.numel, "threads": args.threads, "rows": rows,
                       "deepspeed_ms": ds * 1e3 if ds else None,
                       "copy_ms": {str(k): v * 1e3 for k, v in copy_times.items()}}, f, indent=1)


if __name__ == "__main__":
    main()
