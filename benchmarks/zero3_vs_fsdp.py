"""shardwise ZeRO-3 (and offload variants) vs torch FSDP2 (``fully_shard`` per block) on the demo GPT.

    python benchmarks/zero3_vs_fsdp.py [--steps 40] [--repeats 3] [--procs 2] [--nvme DIR]

Each repetition runs every configuration once, in turn, each in a fresh set
of processes.  Per run: rank 0's median step time after warm-up and each
rank's peak resident memory.  Ratios are against FSDP2 measured in the same
repetition.  Target: ZeRO-3 step-time ratio <= 1.0.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from zero_vs_ddp import CLIP, LR, MICRO, _free_port, join_gloo, time_steps  # noqa: E402

import torch.multiprocessing as mp  # noqa: E402

CONFIGS = {
    "fsdp2": None,
    "zero3": {"stage": 3},
    "zero2_cpu_opt": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
    "zero2_nvme_opt": {"stage": 2, "offload_optimizer": {"device": "nvme"}},
    "zero3_cpu_all": {"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}},
    "zero3_nvme_all": {"stage": 3, "offload_optimizer": {"device": "nvme"}, "offload_param": {"device": "nvme"}},
}


def _worker(rank, world, port, name, steps, out_dir, nvme):
    join_gloo(rank, world, port)
    from model import GPT, GPTConfig, lm_loss

    torch.manual_seed(0)
    model = GPT(GPTConfig())
    if name == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01, foreach=True)

        def step(x, y):
            loss = lm_loss(model(x), y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            opt.step()
            opt.zero_grad()
            return loss
    else:
        import shardwise

        # Units of one transformer block (~200k parameters), like fully_shard per block.
        z = {"reduce_bucket_size": 25 * 2**20 // 4, "stage3_param_persistence_threshold": 0,
             "stage3_prefetch_bucket_size": 250_000, **CONFIGS[name]}
        for key in ("offload_optimizer", "offload_param"):
            if key in z:
                z[key] = {**z[key], "nvme_path": nvme}
        cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_clipping": CLIP,
               "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
               "zero_optimization": z}
        engine, *_ = shardwise.initialize(model=model, config=cfg)

        def step(x, y):
            loss = lm_loss(engine(x), y)
            engine.backward(loss)
            engine.step()
            return loss

    time_steps(step, rank, world, steps, os.path.join(out_dir, f"{name}.{rank}"), warmup=3)


def _run(name, steps, world, nvme):
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(_worker, args=(world, _free_port(), name, steps, out, nvme), nprocs=world,
                           start_method="spawn")
        rows = [open(os.path.join(out, f"{name}.{r}")).read().split() for r in range(world)]
    return float(rows[0][0]), [float(r[1]) for r in rows], float(rows[0][2])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--procs", type=int, default=2)
    ap.add_argument("--nvme", default=None, help="folder for NVMe offload files (default: a temp folder)")
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS))
    args = ap.parse_args()
    nvme = args.nvme or tempfile.mkdtemp(prefix="shardwise-bench-nvme-")
    names = ["fsdp2"] + [c for c in args.configs if c != "fsdp2"]
    res = {n: [] for n in names}
    ratios = {n: [] for n in names}
    for rep in range(args.repeats):
        for n in names:
            res[n].append(_run(n, args.steps, args.procs, nvme))
        for n in names:
            ratios[n].append(res[n][-1][0] / res["fsdp2"][-1][0])
        print(f"repeat {rep + 1}: " + ", ".join(f"{n} {res[n][-1][0] * 1e3:.1f} ms" for n in names), flush=True)
    print(f"\nGPT demo model, {args.procs} processes (gloo, CPU), {args.steps} steps per run, {args.repeats} runs each, "
          f"torch {torch.__version__}")
    print("| configuration | step time (ms) | ratio vs FSDP2 | " +
          " | ".join(f"peak RSS rank {r} (MB)" for r in range(args.procs)) + " | final loss |")
    print("|---" * (4 + args.procs) + "|")
    for n in names:
        rss = " | ".join(f"{statistics.median(x[1][r] for x in res[n]):.0f}" for r in range(args.procs))
        print(f"| {n} | {statistics.median(x[0] for x in res[n]) * 1e3:.1f} | {statistics.median(ratios[n]):.3f} | "
              f"{rss} | {statistics.median(x[2] for x in res[n]):.4f} |")


if __name__ == "__main__":
    main()
