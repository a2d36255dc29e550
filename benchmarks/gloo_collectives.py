"""gloo's own collectives vs shardwise's direct point-to-point reduce-scatter and all-gather.

    python benchmarks/gloo_collectives.py [--procs 2 4] [--numel 830000] [--iters 100]

For each group size, one set of processes times (median over ``--iters`` calls, each after a
barrier, rank 0's wall time; the cases take turns in blocks): gloo's all-reduce of the whole buffer, gloo's reduce-scatter and
all-gather, and ``shardwise.comm``'s reduce-scatter and all-gather, which on gloo exchange chunks
directly (``shardwise/comm/direct.py``).  The buffer defaults to the demo GPT's gradients
(0.83M float32 = 3.3 MB).  ZeRO needs one reduce-scatter and one all-gather per step where DDP
needs one all-reduce: the last column compares those sums.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from zero_vs_ddp import _free_port, join_gloo  # noqa: E402


def _worker(rank: int, world: int, port: int, numel: int, iters: int, out: str) -> None:
    join_gloo(rank, world, port)
    from shardwise import comm

    size = numel // world
    buf = torch.randn(size * world)
    mine = buf[rank * size : (rank + 1) * size]
    cases = {
        "gloo all_reduce": lambda: dist.all_reduce(buf),
        "gloo reduce_scatter": lambda: comm.comm._reduce_scatter_single(mine, buf),
        "gloo all_gather": lambda: comm.comm._all_gather_single(buf, mine),
        "shardwise reduce_scatter": lambda: comm.reduce_scatter_tensor(mine, buf),
        "shardwise all_gather": lambda: comm.all_gather_into_tensor(buf, mine),
    }
    times = {name: [] for name in cases}
    rounds = 5  # blocks of iters // rounds calls of one case, cases in turn: drift hits all alike
    for _ in range(rounds):
        for name, fn in cases.items():
            for _ in range(max(1, iters // rounds)):
                dist.barrier()
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
    if rank == 0:
        with open(out, "w") as f:
            for name, ts in times.items():
                f.write(f"{name}\t{statistics.median(ts) * 1e3}\n")
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--procs", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--numel", type=int, default=830_000)
    ap.add_argument("--iters", type=int, default=100)
    args = ap.parse_args()
    print(f"{args.numel} float32 ({args.numel * 4 / 2**20:.1f} MiB), median of {args.iters} calls, "
          f"torch {torch.__version__}")
    print("| ranks | gloo all-reduce (ms) | gloo reduce-scatter | gloo all-gather | shardwise reduce-scatter "
          "| shardwise all-gather | (shardwise RS + AG) / gloo all-reduce |")
    print("|---|---|---|---|---|---|---|")
    for world in args.procs:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "times")
            mp.start_processes(_worker, args=(world, _free_port(), args.numel, args.iters, out), nprocs=world,
                               start_method="spawn")
            t = dict(line.split("\t") for line in open(out).read().splitlines())
        t = {k: float(v) for k, v in t.items()}
        ratio = (t["shardwise reduce_scatter"] + t["shardwise all_gather"]) / t["gloo all_reduce"]
        print(f"| {world} | {t['gloo all_reduce']:.2f} | {t['gloo reduce_scatter']:.2f} | {t['gloo all_gather']:.2f} "
              f"| {t['shardwise reduce_scatter']:.2f} | {t['shardwise all_gather']:.2f} | {ratio:.2f} |", flush=True)


if __name__ == "__main__":
    main()
