"""shardwise ZeRO-0 vs torch DistributedDataParallel on the demo GPT, 2 processes.

    python benchmarks/ddp_vs_zero0.py [--steps 60] [--repeats 3] [--procs 2]

Each repetition trains the same model on the same data once with each
framework (alternating, so machine drift hits both), every run in its own
fresh set of processes.  Per run: median step time of rank 0 after warm-up,
and the peak resident memory of each rank.  The table shows the medians over
repetitions and the shardwise/DDP ratios.  Target: step-time ratio <= 1.05.
"""

from __future__ import annotations

import argparse
import os
import resource
import socket
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples", "gpt"))
sys.path.insert(0, ROOT)

BUCKET_ELEMENTS = 25 * 1024 * 1024 // 4  # DDP's default 25 MB bucket, in fp32 elements
LR, CLIP, MICRO = 3e-3, 1.0, 8


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _batches(steps: int, rank: int, world: int):
    from model import CharDataset

    data = CharDataset(64)
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        idx = torch.randint(len(data), (MICRO * world,), generator=g)[rank * MICRO : (rank + 1) * MICRO]
        xs, ys = zip(*(data[int(i)] for i in idx))
        yield torch.stack(xs), torch.stack(ys)


def _worker(rank: int, world: int, port: int, framework: str, steps: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo")
    from model import GPT, GPTConfig, lm_loss

    torch.manual_seed(0)
    model = GPT(GPTConfig())
    if framework == "shardwise":
        import shardwise

        cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_clipping": CLIP,
               "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
               "zero_optimization": {"stage": 0, "reduce_bucket_size": BUCKET_ELEMENTS}}
        engine, *_ = shardwise.initialize(model=model, config=cfg)

        def step(x, y):
            loss = lm_loss(engine(x), y)
            engine.backward(loss)
            engine.step()
            return loss
    else:
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01, foreach=True)

        def step(x, y):
            loss = lm_loss(ddp(x), y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            opt.step()
            opt.zero_grad(set_to_none=False)
            return loss

    times = []
    for x, y in _batches(steps, rank, world):
        t0 = time.perf_counter()
        loss = step(x, y)
        times.append(time.perf_counter() - t0)
    dist.barrier()
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    warm = max(5, steps // 5)
    with open(os.path.join(out_dir, f"{framework}.{rank}"), "w") as f:
        f.write(f"{statistics.median(times[warm:])} {peak_mb} {loss.item()}\n")
    dist.destroy_process_group()


def _run(framework: str, steps: int, world: int) -> tuple[float, list[float], float]:
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(_worker, args=(world, _free_port(), framework, steps, out), nprocs=world,
                           start_method="spawn")
        rows = [open(os.path.join(out, f"{framework}.{r}")).read().split() for r in range(world)]
    return float(rows[0][0]), [float(r[1]) for r in rows], float(rows[0][2])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--procs", type=int, default=2)
    args = ap.parse_args()
    res: dict[str, list] = {"shardwise": [], "ddp": []}
    ratios = []
    for rep in range(args.repeats):
        pair = {}
        for fw in ("shardwise", "ddp"):
            pair[fw] = _run(fw, args.steps, args.procs)
            res[fw].append(pair[fw])
        ratios.append(pair["shardwise"][0] / pair["ddp"][0])
        print(f"repeat {rep + 1}: shardwise {pair['shardwise'][0] * 1e3:.1f} ms/step, "
              f"ddp {pair['ddp'][0] * 1e3:.1f} ms/step, ratio {ratios[-1]:.3f}", flush=True)

    def med(fw, i):
        return statistics.median(r[i] for r in res[fw])

    print(f"\nGPT demo model, {args.procs} processes (gloo, CPU), {args.steps} steps per run, "
          f"{args.repeats} runs each, torch {torch.__version__}")
    print("| metric | shardwise ZeRO-0 | torch DDP | ratio |")
    print("|---|---|---|---|")
    print(f"| step time, median (ms) | {med('shardwise', 0) * 1e3:.1f} | {med('ddp', 0) * 1e3:.1f} | "
          f"{statistics.median(ratios):.3f} |")
    for r in range(args.procs):
        sw = statistics.median(x[1][r] for x in res["shardwise"])
        dd = statistics.median(x[1][r] for x in res["ddp"])
        print(f"| peak RSS rank {r} (MB) | {sw:.0f} | {dd:.0f} | {sw / dd:.3f} |")
    print(f"| final loss (rank 0) | {med('shardwise', 2):.4f} | {med('ddp', 2):.4f} | |")


if __name__ == "__main__":
    main()
