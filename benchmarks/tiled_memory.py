"""Tiled vs untiled MLP and logits+loss on one long sequence: peak memory and time.

    python benchmarks/tiled_memory.py [--seq 8192] [--hidden 1024] [--intermediate 2816]
                                      [--vocab 32000] [--shards 0] [--json out.json]

A Llama MLP (``down(silu(gate(x)) * up(x))``) and an lm_head + cross-entropy of the given sizes,
forward + backward on ``[1, seq, hidden]`` fp32 hidden states, untiled and with
``TiledMLP`` / ``TiledFusedLogitsLoss`` (``--shards`` tiles; 0: ``ceil(seq / hidden)``, ALST's
rule).  Each variant runs in a fresh process with one intra-op thread per core; the peak is
the highest resident memory during forward + backward above the level before it
(``shardwise.profiling.PeakMemory``).  Outputs and gradients of the tiled run are compared with
the untiled run's (max relative difference printed).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _worker(kind: str, tiled: bool, args) -> dict:
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    from shardwise.profiling import PeakMemory
    from shardwise.runtime.sequence_parallel.tiled import TiledFusedLogitsLoss, TiledMLP

    torch.manual_seed(0)
    shards = args.shards or math.ceil(args.seq / args.hidden)
    x = torch.randn(1, args.seq, args.hidden) * 0.5
    if kind == "mlp":
        gate, up, down = (nn.Linear(args.hidden, args.intermediate, bias=False),
                          nn.Linear(args.hidden, args.intermediate, bias=False),
                          nn.Linear(args.intermediate, args.hidden, bias=False))
        mod = nn.ModuleDict({"gate": gate, "up": up, "down": down})
        g = torch.randn(1, args.seq, args.hidden)

        def fn(self, h):
            return self["down"](F.silu(self["gate"](h)) * self["up"](h))

        def step(xi):
            out = TiledMLP.apply(fn, mod, xi, shards, list(mod.parameters())) if tiled else fn(mod, xi)
            out.backward(g)
            return out.detach()
    else:
        mod = nn.Linear(args.hidden, args.vocab, bias=False)
        y = torch.randint(0, args.vocab, (1, args.seq))

        def fn(self, h, labels):
            return F.cross_entropy(self(h).reshape(-1, args.vocab), labels.reshape(-1), reduction="sum")

        def step(xi):
            if tiled:
                loss = TiledFusedLogitsLoss.apply(fn, mod, xi, y, None, shards, [mod.weight], "sum")
            else:
                loss = fn(mod, xi, y)
            loss.backward()
            return loss.detach().reshape(1)

    xi = x.clone().requires_grad_()
    t0 = time.perf_counter()
    with PeakMemory("cpu") as peak:
        out = step(xi)
    seconds = time.perf_counter() - t0
    path = os.path.join(args.tmp, f"{kind}_{int(tiled)}.pt")
    torch.save({"out": out, "x": xi.grad, **{n: p.grad for n, p in mod.named_parameters()}}, path)
    return {"kind": kind, "tiled": tiled, "shards": shards if tiled else 1, "peak_mib": round(peak.bytes / 2**20, 1),
            "seconds": round(seconds, 2)}


def _compare(tmp: str, kind: str) -> float:
    import torch

    a = torch.load(os.path.join(tmp, f"{kind}_0.pt"), weights_only=True)
    b = torch.load(os.path.join(tmp, f"{kind}_1.pt"), weights_only=True)
    return max(float((a[k] - b[k]).abs().max() / a[k].abs().max().clamp_min(1e-30)) for k in a)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--intermediate", type=int, default=2816)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--shards", type=int, default=0)
    p.add_argument("--json", default=None)
    p.add_argument("--worker", nargs=2, metavar=("KIND", "TILED"), help=argparse.SUPPRESS)
    p.add_argument("--tmp", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        print(json.dumps(_worker(args.worker[0], args.worker[1] == "1", args)))
        return
    import tempfile

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for kind in ("mlp", "logits_loss"):
            for tiled in (False, True):
                cmd = [sys.executable, os.path.abspath(__file__), "--worker", kind, str(int(tiled)), "--tmp", tmp,
                       "--seq", str(args.seq), "--hidden", str(args.hidden), "--intermediate",
                       str(args.intermediate), "--vocab", str(args.vocab), "--shards", str(args.shards)]
                env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
                out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
                row = json.loads(out.strip().splitlines()[-1])
                rows.append(row)
                print(json.dumps(row), flush=True)
            rows[-1]["max_rel_diff"] = _compare(tmp, kind)
    print(f"\nseq {args.seq}, hidden {args.hidden}, intermediate {args.intermediate}, vocab {args.vocab}, fp32")
    print("| computation | tiles | peak MiB | time s | peak vs untiled | time vs untiled | max rel. diff |")
    print("|---|---|---|---|---|---|---|")
    for i in range(0, len(rows), 2):
        base, tiled = rows[i], rows[i + 1]
        for r in (base, tiled):
            rel = "" if r is base else f"{r['peak_mib'] / base['peak_mib']:.2f}x"
            t_rel = "" if r is base else f"{r['seconds'] / base['seconds']:.2f}x"
            diff = f"{r['max_rel_diff']:.1e}" if "max_rel_diff" in r else ""
            print(f"| {r['kind']} | {r['shards']} | {r['peak_mib']} | {r['seconds']} | {rel} | {t_rel} | {diff} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
