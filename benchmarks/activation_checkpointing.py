"""Activation checkpointing: peak memory and step time of the demo GPT with and without it.

    python benchmarks/activation_checkpointing.py [--batch 32] [--seq 128] [--layers 8] [--embd 256]

Each configuration trains a few steps in a fresh process (one intra-op thread); the peak is
the highest memory in use during forward + backward of a step above the level before it
(``shardwise.profiling.PeakMemory``: CPU resident memory, or the accelerator allocator's
peak). Losses must match exactly. The memory estimator's activation figures are printed
next to the measurements for comparison.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples", "gpt"))


def build(cfg_kwargs: dict, use_ckpt: bool):
    import torch

    from model import GPT, GPTConfig
    from shardwise import checkpointing

    class CheckpointedGPT(GPT):
        def forward(self, idx):
            x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
            for block in self.blocks:
                x = checkpointing.checkpoint(block, x) if use_ckpt else block(x)
            return self.head(self.ln_f(x))

    torch.manual_seed(0)
    return CheckpointedGPT(GPTConfig(**cfg_kwargs))


def measure(args) -> dict:
    import torch

    from model import lm_loss
    from shardwise.profiling import PeakMemory

    torch.set_num_threads(1)
    cfg = dict(n_layer=args.layers, n_embd=args.embd, n_head=args.heads, block_size=args.seq, vocab_size=128)
    model = build(cfg, args.ckpt)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    losses, peaks, times = [], [], []
    for _ in range(args.steps):
        idx = torch.randint(0, 128, (args.batch, args.seq + 1), generator=g)
        t0 = time.perf_counter()
        with PeakMemory("cpu") as peak:
            loss = lm_loss(model(idx[:, :-1]), idx[:, 1:])
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        times.append(time.perf_counter() - t0)
        peaks.append(peak.bytes)
        losses.append(loss.item())
    return {"losses": losses, "peak": max(peaks[1:]), "step_s": sum(times[1:]) / (len(times) - 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--embd", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--ckpt", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(measure(args)))
        return
    base = [sys.executable, os.path.abspath(__file__), "--child"] + [
        f"--{k}={getattr(args, k)}" for k in ("batch", "seq", "layers", "embd", "heads", "steps")]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    res = {}
    for label, extra in (("without", []), ("with", ["--ckpt"])):
        out = subprocess.run(base + extra, capture_output=True, text=True, env=env, check=True).stdout
        res[label] = json.loads(out.strip().splitlines()[-1])
    from shardwise.profiling import estimate_activations

    kw = dict(seq_len=args.seq, micro_batch=args.batch, hidden_size=args.embd, num_layers=args.layers,
              num_heads=args.heads, vocab_size=128, bytes_per_value=4)
    est = {"without": estimate_activations(**kw), "with": estimate_activations(**kw, checkpointing=True)}
    same = res["without"]["losses"] == res["with"]["losses"]
    print(f"GPT {args.layers} layers x {args.embd} wide, {args.heads} heads, batch {args.batch} x seq {args.seq}, "
          f"fp32, 1 thread")
    print(f"{'activation checkpointing':<26}{'peak fwd+bwd MiB':>18}{'estimate MiB':>14}{'step ms':>10}")
    for label in ("without", "with"):
        r = res[label]
        print(f"{label:<26}{r['peak'] / 2**20:>18.1f}{est[label] / 2**20:>14.1f}{1000 * r['step_s']:>10.1f}")
    print(f"peak memory saved: {100 * (1 - res['with']['peak'] / res['without']['peak']):.0f}%, "
          f"losses identical: {same}")
    if not same:
        sys.exit("losses differ with activation checkpointing")


if __name__ == "__main__":
    main()
