"""Launcher test script: rank 1 raises while rank 0 sleeps and would never end on its own."""
import os
import sys
import time

import torch
import torch.distributed as dist

pid_dir = sys.argv[-1]
torch.set_num_threads(1)
dist.init_process_group("gloo")
rank = dist.get_rank()
with open(os.path.join(pid_dir, f"rank{rank}.pid"), "w") as f:
    f.write(str(os.getpid()))
dist.barrier()  # both pid files exist from here on
if rank == 1:
    raise RuntimeError("rank one gives up")
print("rank 0 sleeping", flush=True)
time.sleep(600)
