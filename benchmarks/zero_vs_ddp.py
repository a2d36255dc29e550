"""shardwise ZeRO stages vs torch DDP (and ZeroRedundancyOptimizer) on the demo GPT.

    python benchmarks/zero_vs_ddp.py [--stages 0 1 2] [--steps 60] [--repeats 3] [--procs 2]

Each repetition trains the same model on the same data once with every
configuration (in turn, so machine drift hits all), every run in its own
fresh set of processes.  Per run: median step time of rank 0 after warm-up,
peak resident memory of each rank, and the model-state bytes of rank 0
(parameters + gradients + master weights + optimizer states).  The table
shows medians over repetitions and ratios against DDP.  Target: step-time
ratio <= 1.05 for every stage.
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


def _state_bytes(model, opt) -> int:
    params = sum(p.nbytes for p in model.parameters())
    grads = sum(p.grad.nbytes for p in model.parameters() if p.grad is not None)
    states = sum(v.nbytes for s in opt.state.values() for v in s.values()
                 if isinstance(v, torch.Tensor) and v.numel() > 1)
    return params + grads + states


def join_gloo(rank: int, world: int, port: int) -> None:
    """Join a local gloo group as ``rank`` of ``world``, with the cores shared out between ranks."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo")


def _worker(rank: int, world: int, port: int, framework: str, steps: int, out_dir: str) -> None:
    join_gloo(rank, world, port)
    from model import GPT, GPTConfig, lm_loss

    torch.manual_seed(0)
    model = GPT(GPTConfig())
    if framework in ("zero0", "zero1", "zero2"):
        import shardwise

        cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_clipping": CLIP,
               "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
               "zero_optimization": {"stage": int(framework[-1]), "reduce_bucket_size": BUCKET_ELEMENTS}}
        engine, *_ = shardwise.initialize(model=model, config=cfg)

        def step(x, y):
            loss = lm_loss(engine(x), y)
            engine.backward(loss)
            engine.step()
            return loss

        def state_bytes():
            return engine.memory_breakdown().total
    else:
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        if framework == "zero_redundancy":
            from torch.distributed.optim import ZeroRedundancyOptimizer

            opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=LR,
                                          weight_decay=0.01, foreach=True)
        else:
            opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01, foreach=True)

        def state_bytes():
            return _state_bytes(model, opt.optim if hasattr(opt, "optim") else opt)

        def step(x, y):
            loss = lm_loss(ddp(x), y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            opt.step()
            opt.zero_grad(set_to_none=False)
            return loss

    time_steps(step, rank, world, steps, os.path.join(out_dir, f"{framework}.{rank}"), extra=state_bytes)


def time_steps(step, rank: int, world: int, steps: int, out_path: str, *, extra=None, warmup: int = 5) -> None:
    """Run ``step`` on the benchmark batches; write rank's median step time (after warm-up), peak
    RSS (MB), last loss and ``extra()`` to ``out_path``; then leave the process group."""
    times = []
    for x, y in _batches(steps, rank, world):
        t0 = time.perf_counter()
        loss = step(x, y)
        times.append(time.perf_counter() - t0)
    dist.barrier()
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    tail = f" {extra()}" if extra is not None else ""
    with open(out_path, "w") as f:
        f.write(f"{statistics.median(times[max(warmup, steps // 5):])} {peak_mb} {loss.item()}{tail}\n")
    dist.destroy_process_group()


def _run(framework: str, steps: int, world: int) -> tuple[float, list[float], float, int]:
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(_worker, args=(world, _free_port(), framework, steps, out), nprocs=world,
                           start_method="spawn")
        rows = [open(os.path.join(out, f"{framework}.{r}")).read().split() for r in range(world)]
    return float(rows[0][0]), [float(r[1]) for r in rows], float(rows[0][2]), int(rows[0][3])


NAMES = {"zero0": "shardwise ZeRO-0", "zero1": "shardwise ZeRO-1", "zero2": "shardwise ZeRO-2",
         "ddp": "torch DDP", "zero_redundancy": "DDP + ZeroRedundancyOptimizer"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--procs", type=int, default=2)
    ap.add_argument("--no-zero-redundancy", action="store_true", help="skip torch's ZeroRedundancyOptimizer")
    args = ap.parse_args()
    frameworks = [f"zero{s}" for s in args.stages] + ["ddp"]
    if not args.no_zero_redundancy:
        frameworks.append("zero_redundancy")
    res: dict[str, list] = {fw: [] for fw in frameworks}
    ratios: dict[str, list[float]] = {fw: [] for fw in frameworks}
    for rep in range(args.repeats):
        for fw in frameworks:
            res[fw].append(_run(fw, args.steps, args.procs))
        for fw in frameworks:
            ratios[fw].append(res[fw][-1][0] / res["ddp"][-1][0])
        print(f"repeat {rep + 1}: " + ", ".join(f"{fw} {res[fw][-1][0] * 1e3:.1f} ms" for fw in frameworks), flush=True)

    def med(fw, i):
        return statistics.median(r[i] for r in res[fw])

    print(f"\nGPT demo model, {args.procs} processes (gloo, CPU), {args.steps} steps per run, "
          f"{args.repeats} runs each, torch {torch.__version__}")
    print("| configuration | step time (ms) | ratio vs DDP | model states rank 0 (MB) | ratio vs DDP | "
          + " | ".join(f"peak RSS rank {r} (MB)" for r in range(args.procs)) + " | final loss |")
    print("|---" * (5 + args.procs + 1) + "|")
    ddp_states = med("ddp", 3)
    for fw in frameworks:
        rss = " | ".join(f"{statistics.median(x[1][r] for x in res[fw]):.0f}" for r in range(args.procs))
        print(f"| {NAMES[fw]} | {med(fw, 0) * 1e3:.1f} | {statistics.median(ratios[fw]):.3f} | "
              f"{med(fw, 3) / 2**20:.2f} | {med(fw, 3) / ddp_states:.3f} | {rss} | {med(fw, 2):.4f} |")


if __name__ == "__main__":
    main()
