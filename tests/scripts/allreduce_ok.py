"""Launcher test script: all-reduce across the ranks and report what this rank was given."""
import argparse
import json
import os

import torch
import torch.distributed as dist

parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", type=int, default=None)
parser.add_argument("--tag", default="")
parser.add_argument("rest", nargs="*")
args = parser.parse_args()

torch.set_num_threads(1)
dist.init_process_group("gloo")
rank = dist.get_rank()
value = torch.tensor([float(rank + 1)])
dist.all_reduce(value)
report = {
    "rank": rank,
    "world_size": dist.get_world_size(),
    "local_rank_arg": args.local_rank,
    "env": {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE",
                                            "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                                            "OMP_NUM_THREADS")},
    "sum": value.item(),
    "tag": args.tag,
    "rest": args.rest,
}
print(f"REPORT {json.dumps(report, sort_keys=True)}", flush=True)
dist.destroy_process_group()
