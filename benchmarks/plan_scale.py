"""How process-group creation grows with the world size: ``shardwise plan``'s fake world at W ranks.

    python benchmarks/plan_scale.py                       # W = 1024, 4096, 16384
    python benchmarks/plan_scale.py --worlds 1024 4096 --tensor 8 --pipe 4

Every rank of a real run creates every process group of the grid (torch's ``new_group`` is collective), so
what one rank spends creating them is what start-up costs at that scale. This builds the grid of a
``data x pipe x tensor`` layout exactly as ``initialize`` does, on torch's fake backend in this one
process (rank 0 of W), and prints the groups created and the seconds they took, per W, plus the whole
plan's time (the reference GPT on the meta device; one rank reported). docs/planning.md has a table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worlds", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--tensor", type=int, default=8)
    ap.add_argument("--pipe", type=int, default=4)
    ap.add_argument("--gpus_per_node", type=int, default=8)
    ap.add_argument("--json", default=None, help="also write the rows as JSON")
    args = ap.parse_args()

    import logging

    logging.getLogger("shardwise").setLevel(logging.WARNING)
    from shardwise.planning import make_plan

    model = "gpt:vocab_size=512,seq_len=128,hidden=64,n_layers=8,n_heads=8"
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 8, "bf16": {"enabled": True},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "zero_optimization": {"stage": 1},
              "tensor_parallel": {"autotp_size": args.tensor}}
    rows = []
    print(f"layout: pipe {args.pipe} x tensor {args.tensor} x data W/{args.pipe * args.tensor}; "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print("| W | process groups | group creation (s) | per 1k ranks (s) | whole plan (s) |")
    print("|---|---|---|---|---|")
    for world in args.worlds:
        t = time.perf_counter()
        plan = make_plan(world=world, gpus_per_node=args.gpus_per_node, model=model, config=config, pipe=args.pipe,
                         partition_method="uniform", ranks=[0])
        whole = time.perf_counter() - t
        rows.append({"world": world, "groups": plan.group_count, "group_seconds": plan.group_seconds,
                     "plan_seconds": whole})
        print(f"| {world:,} | {plan.group_count:,} | {plan.group_seconds:.2f} | "
              f"{plan.group_seconds / world * 1000:.3f} | {whole:.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
