"""Launcher test script: train a tiny model with checkpoints, resuming from `latest`.

Every rank saves a checkpoint every --save_every steps and, on start, loads the latest
one (a restarted job resumes there). With --kill_at N, rank 1 of the first attempt
kills itself with SIGKILL after step N. With --stall_at N, rank 1 stops calling
collectives after step N (it sleeps). Rank 0 writes the final parameters' hash to --out.
"""
import argparse
import hashlib
import json
import os
import signal
import time

import torch

import shardwise

parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", type=int)
parser.add_argument("--save_dir", required=True)
parser.add_argument("--out", required=True)
parser.add_argument("--steps", type=int, default=12)
parser.add_argument("--save_every", type=int, default=4)
parser.add_argument("--kill_at", type=int, default=-1)
parser.add_argument("--stall_at", type=int, default=-1)
args = parser.parse_args()

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
          "zero_optimization": {"stage": 0, "reduce_bucket_size": 300}}
engine, _, _, _ = shardwise.initialize(model=model, model_parameters=model.parameters(),
                                       config=config)
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
path, _ = engine.load_checkpoint(args.save_dir)
print(f"attempt {attempt} starts at step {engine.global_steps} (loaded {path})", flush=True)
losses = []
while engine.global_steps < args.steps:
    step = engine.global_steps
    g = torch.Generator().manual_seed(1000 * step + 10 * engine.micro_steps + engine.global_rank)
    x = torch.randn(4, 16, generator=g)
    y = torch.randn(4, 4, generator=g)
    loss = torch.nn.functional.mse_loss(engine(x), y)
    engine.backward(loss)
    engine.step()
    if engine.global_steps != step:  # an optimizer step happened
        losses.append(engine.get_loss())
        if engine.global_steps % args.save_every == 0:
            engine.save_checkpoint(args.save_dir)
        if engine.global_rank == 1 and attempt == 0 and engine.global_steps == args.kill_at:
            print("rank 1 kills itself with SIGKILL", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        if engine.global_rank == 1 and engine.global_steps == args.stall_at:
            print("rank 1 stops calling collectives", flush=True)
            time.sleep(120)
with open(f"{args.out}.rank{engine.global_rank}", "w") as f:
    json.dump({"cores": sorted(os.sched_getaffinity(0)), "omp": os.environ.get("OMP_NUM_THREADS")}, f)
if engine.global_rank == 0:
    digest = hashlib.sha256()
    for name, t in sorted(engine.module.state_dict().items()):
        digest.update(name.encode())
        digest.update(t.detach().contiguous().numpy().tobytes())
    with open(args.out, "w") as f:
        json.dump({"params": digest.hexdigest(), "steps": engine.global_steps,
                   "attempt": attempt, "losses": losses}, f)
