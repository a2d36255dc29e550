"""Eager vs compiled training step on the demo GPT: shardwise ZeRO-0 and ZeRO-3 next to torch DDP and FSDP2.

    python benchmarks/compile.py [--backend inductor] [--steps 40] [--repeats 3] [--procs 2] [--tiny]

Every framework is compiled the same way, as ``engine.compile()`` does it: each transformer block's
``forward`` through ``torch.compile`` (torchtitan's per-block compile), embedding and head eager;
FSDP2 is ``fully_shard`` per block after compiling, ZeRO-3 uses units of one block (as in
benchmarks/zero3_vs_fsdp.py). Each repetition runs every configuration once, in turn (A B A B, so
machine drift hits all), each in fresh processes. Per run: rank 0's median step time after warm-up and
its first step, which holds the compilation; the compile time is the compiled first step minus the eager
first step, reported apart. Ratios: compiled over eager step time of the same framework.
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from zero_vs_ddp import CLIP, LR, MICRO, _batches, _free_port, join_gloo  # noqa: E402

FRAMEWORKS = ["zero0", "zero3", "ddp", "fsdp2"]
NAMES = {"zero0": "shardwise ZeRO-0", "zero3": "shardwise ZeRO-3", "ddp": "torch DDP", "fsdp2": "torch FSDP2"}


def _model(tiny: bool):
    from model import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=2, n_embd=32, block_size=64) if tiny else GPTConfig())


def _compile_blocks(model, backend: str) -> None:
    for block in model.blocks:
        block.forward = torch.compile(block.forward, backend=backend)


def _step_fn(framework: str, model, *, compiled: bool, backend: str):
    from model import lm_loss

    if framework.startswith("zero"):
        import shardwise

        zero = {"stage": int(framework[-1]), "reduce_bucket_size": 25 * 2**20 // 4}
        if zero["stage"] == 3:  # units of one transformer block, like fully_shard per block
            zero.update(stage3_param_persistence_threshold=0,
                        stage3_prefetch_bucket_size=sum(p.numel() for p in model.blocks[0].parameters()))
        engine, *_ = shardwise.initialize(model=model, config={
            "train_micro_batch_size_per_gpu": MICRO, "gradient_clipping": CLIP,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}}, "zero_optimization": zero})
        if compiled:
            engine.compile(backend=backend)

        def step(x, y):
            loss = lm_loss(engine(x), y)
            engine.backward(loss)
            engine.step()
            return loss
        return step
    if compiled:
        _compile_blocks(model, backend)
    if framework == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        wrapped = fully_shard(model)
    else:
        wrapped = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01, foreach=True)

    def step(x, y):
        loss = lm_loss(wrapped(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        return loss
    return step


def _worker(rank, world, port, run, steps, out_dir, backend, tiny):
    join_gloo(rank, world, port)
    framework, mode = run.split(":")
    step = _step_fn(framework, _model(tiny), compiled=mode == "compiled", backend=backend)
    times = []
    for x, y in _batches(steps, rank, world):
        t0 = time.perf_counter()
        loss = step(x, y)
        times.append(time.perf_counter() - t0)
    dist.barrier()
    with open(os.path.join(out_dir, f"{rank}"), "w") as f:
        f.write(f"{statistics.median(times[max(3, steps // 5):])} {times[0]} {loss.item()}\n")
    dist.destroy_process_group()


def _run(run: str, steps: int, world: int, backend: str, tiny: bool) -> tuple[float, float, float]:
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(_worker, args=(world, _free_port(), run, steps, out, backend, tiny), nprocs=world,
                           start_method="spawn")
        median, first, loss = open(os.path.join(out, "0")).read().split()
    return float(median), float(first), float(loss)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="inductor")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--procs", type=int, default=2)
    ap.add_argument("--frameworks", nargs="+", default=FRAMEWORKS, choices=FRAMEWORKS)
    ap.add_argument("--tiny", action="store_true", help="a 2-layer, 32-wide GPT (to check the script runs)")
    args = ap.parse_args()
    if args.steps < 5:
        raise SystemExit("--steps must be at least 5 (3 warm-up steps are left out of the median)")
    runs = [f"{fw}:{mode}" for fw in args.frameworks for mode in ("eager", "compiled")]
    res: dict[str, list] = {r: [] for r in runs}
    for rep in range(args.repeats):
        for r in runs:
            res[r].append(_run(r, args.steps, args.procs, args.backend, args.tiny))
        print(f"repeat {rep + 1}: " + ", ".join(f"{r} {res[r][-1][0] * 1e3:.1f} ms" for r in runs), flush=True)

    def med(r, i):
        return statistics.median(x[i] for x in res[r])

    print(f"\nGPT demo model{' (tiny)' if args.tiny else ''}, {args.procs} processes (gloo, CPU), backend "
          f"{args.backend}, {args.steps} steps per run, {args.repeats} runs each, torch {torch.__version__}")
    print("| framework | eager step (ms) | compiled step (ms) | compiled / eager | compile time (s) | "
          "final loss eager | final loss compiled |")
    print("|---|---|---|---|---|---|---|")
    for fw in args.frameworks:
        e, c = f"{fw}:eager", f"{fw}:compiled"
        ratio = statistics.median(ce[0] / ee[0] for ce, ee in zip(res[c], res[e]))
        print(f"| {NAMES[fw]} | {med(e, 0) * 1e3:.1f} | {med(c, 0) * 1e3:.1f} | {ratio:.3f} | "
              f"{med(c, 1) - med(e, 1):.1f} | {med(e, 2):.4f} | {med(c, 2):.4f} |")


if __name__ == "__main__":
    main()
