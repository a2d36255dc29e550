"""Python calls of one training step (``engine.backward`` + ``engine.step`` at the accumulation boundary), counted
with cProfile on rank 0 of 2 CPU ranks over gloo: ZeRO-1 and ZeRO-2 on the reference GPT, and a model with one MoE
layer at ep_size 2 under ZeRO 0, 1 and 2. A count that does not depend on how loaded the machine is, to compare
two trees:

    python benchmarks/step_calls.py [--tree DIR]

Prints ``{case: [total calls, primitive calls, loss]}`` (the third step, after two warm-up steps; the loss shows
both trees trained the same).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CASES = ("zero1", "zero2", "moe0", "moe1", "moe2")


def worker() -> None:
    import torch

    import shardwise
    from shardwise.models.gpt import GPT, GPTConfig
    from shardwise.moe.layer import MoE

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp = torch.nn.Linear(8, 8)
            expert = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
            self.moe = MoE(8, expert, num_experts=4, ep_size=2, k=2)
            self.out = torch.nn.Linear(8, 8)

        def forward(self, x, y):
            h, _, _ = self.moe(self.inp(x))
            return torch.nn.functional.mse_loss(self.out(h), y)

    torch.set_num_threads(1)
    shardwise.init_distributed()
    rank = torch.distributed.get_rank()
    out = {}
    for name in CASES:
        torch.manual_seed(0)
        ds = {"train_batch_size": 2, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": int(name[-1])}}
        g = torch.Generator().manual_seed(rank)
        if name.startswith("zero"):
            model = GPT(GPTConfig(vocab_size=64, seq_len=16, hidden=32, n_layers=2, n_heads=2))
            tokens = torch.randint(0, 64, (1, 17), generator=g)
            batch = (tokens[:, :-1], tokens[:, 1:])
        else:
            model = Net()
            batch = (torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g))
        engine = shardwise.initialize(model=model, config=ds)[0]
        prof = cProfile.Profile()
        for step in range(3):
            loss = engine(*batch)
            if step == 2:
                prof.enable()
            engine.backward(loss)
            engine.step()
            prof.disable()
        stats = pstats.Stats(prof)
        out[name] = [stats.total_calls, stats.prim_calls, float(loss)]
        engine.destroy()
    if rank == 0:
        print("RESULT " + json.dumps(out), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--tree", default=ROOT)
    args = p.parse_args()
    if args.worker:
        worker()
        return
    from engine_walk import run_two_ranks

    print(run_two_ranks(__file__, args.tree))


if __name__ == "__main__":
    main()
