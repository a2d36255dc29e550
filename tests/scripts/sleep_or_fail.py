"""Launcher test script: every rank joins, then one rank exits with a code while the others sleep."""
import argparse
import os
import sys
import time

import torch.distributed as dist

parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", type=int)
parser.add_argument("--fail_rank", type=int, default=-1)
parser.add_argument("--code", type=int, default=7)
args = parser.parse_args()
dist.init_process_group("gloo")
rank = dist.get_rank()
dist.barrier()
print(f"ready pid={os.getpid()}", flush=True)
if rank == args.fail_rank:
    time.sleep(1)
    print(f"rank {rank} exits with {args.code}", file=sys.stderr, flush=True)
    os._exit(args.code)
time.sleep(300)
