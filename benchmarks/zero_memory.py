"""Peak live tensor bytes per rank at ZeRO stages 0-3 against ZeRO's formulas.

    python benchmarks/zero_memory.py [--procs 2] [--steps 3] [--layers 6] [--embd 484] [--bucket N]

The demo GPT (6 layers, width 484: 17.06M parameters), fp32, AdamW, every stage in its own fresh
set of gloo processes. The peak is the largest sum of the distinct tensor storages Python can reach
(``shardwise.profiling.LiveTensorPeak``), over every step after the first (the optimizer's states
exist from the first step on), at two places: "at the step", between backward and the optimizer
step (what stays alive: ZeRO's formulas count these), and "peak in backward", also sampled after
each parameter's gradient is accumulated and after the step (adding the short-lived gradient buckets
in flight, which at stage 2 are as large as the largest parameters, and activations). It counts model states, the framework's buffers and the activations Python can
reach; one sequence of 16 tokens per rank keeps those small. It does not depend on the machine's load. Formulas per rank for fp32 Adam (Ψ
parameters, N ranks): stage 0 16Ψ, stage 1 8Ψ + 8Ψ/N, stage 2 4Ψ + 12Ψ/N, stage 3 16Ψ/N.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples", "gpt"))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from zero_vs_ddp import _batches, _free_port, join_gloo  # noqa: E402


def formula(stage: int, psi: int, n: int) -> float:
    return {0: 16 * psi, 1: 8 * psi + 8 * psi / n, 2: 4 * psi + 12 * psi / n, 3: 16 * psi / n}[stage]


def _worker(rank: int, world: int, port: int, stage: int, args, out_dir: str) -> None:
    join_gloo(rank, world, port)
    import torch.distributed as dist

    import shardwise
    from model import GPT, GPTConfig, lm_loss
    from shardwise.profiling import LiveTensorPeak

    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=args.layers, n_embd=args.embd, n_head=4))
    psi = sum(p.numel() for p in model.parameters())
    zero = {"stage": stage}
    if args.bucket:
        zero["reduce_bucket_size"] = args.bucket
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_clipping": 1.0,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": zero}
    engine, *_ = shardwise.initialize(model=model, config=cfg)
    peak, at_step = LiveTensorPeak(), LiveTensorPeak()
    for i, (x, y) in enumerate(_batches(args.steps, rank, world)):
        if i == 1:  # from the second step on: the optimizer's states exist
            peak.watch(engine.module)
        x, y = x[:1, :16], y[:1, :16]  # one short sequence: activations small next to the model states
        loss = lm_loss(engine(x), y)
        engine.backward(loss)
        del loss
        if i >= 1:
            peak.sample()
            at_step.sample()  # between backward and step: what stays alive besides the transient buckets
        engine.step()
        if i >= 1:
            peak.sample()
    peak.close()
    with open(os.path.join(out_dir, f"{stage}.{rank}"), "w") as f:
        f.write(f"{psi} {peak.bytes} {at_step.bytes}\n")
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3])
    ap.add_argument("--procs", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--embd", type=int, default=484)
    ap.add_argument("--bucket", type=int, default=0, help="reduce_bucket_size (default: the config's)")
    args = ap.parse_args()
    rows = []
    for stage in args.stages:
        with tempfile.TemporaryDirectory() as out:
            mp.start_processes(_worker, args=(args.procs, _free_port(), stage, args, out), nprocs=args.procs,
                               start_method="spawn")
            got = [open(os.path.join(out, f"{stage}.{r}")).read().split() for r in range(args.procs)]
        psi = int(got[0][0])
        rows.append((stage, psi, [int(g[1]) for g in got], [int(g[2]) for g in got]))
    mib = 2**20
    print(f"GPT {args.layers} layers, width {args.embd}: Ψ = {rows[0][1] / 1e6:.2f}M parameters, fp32 AdamW, "
          f"{args.procs} gloo ranks, reduce_bucket_size {args.bucket or 'default'}, torch {torch.__version__}")
    print("| stage | formula (MiB) | at the step, per rank (MiB) | vs formula | peak in backward, per rank (MiB) "
          "| vs formula |")
    print("|---|---|---|---|---|---|")
    for stage, psi, peaks, steps in rows:
        f = formula(stage, psi, args.procs)
        print(f"| {stage} | {f / mib:.1f} | {' / '.join(f'{p / mib:.1f}' for p in steps)} | {max(steps) / f:.3f} | "
              f"{' / '.join(f'{p / mib:.1f}' for p in peaks)} | {max(peaks) / f:.3f} |")


if __name__ == "__main__":
    main()
