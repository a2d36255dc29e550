"""Fault-injection script: all-reduce in a loop through shardwise.comm (collective timeout from
``shardwise run --comm_timeout``), printing ``step <n>`` after each."""
import time

import torch

from shardwise import comm

torch.set_num_threads(1)
comm.init_distributed()
step = 0
while True:
    comm.all_reduce(torch.ones(64))
    step += 1
    print(f"step {step}", flush=True)
    time.sleep(0.05)
