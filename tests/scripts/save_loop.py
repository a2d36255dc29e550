"""Fault-injection script: train a small model and save a checkpoint after every step, forever.

Tags rotate over three names, so a save often replaces an existing tag. After each save returns,
rank 0 prints ``saved <global_steps>``; the test kills something at a random moment (mostly
inside a save) and checks what is on disk.
"""
import argparse

import torch

import shardwise

parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", type=int)
parser.add_argument("--save_dir", required=True)
args = parser.parse_args()

torch.set_num_threads(1)
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(128, 128) for _ in range(4)])
config = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
          "zero_optimization": {"stage": 1, "reduce_bucket_size": 20000}}
engine, *_ = shardwise.initialize(model=model, config=config)
engine.load_checkpoint(args.save_dir)
print(f"ready pid={__import__('os').getpid()}", flush=True)
x = torch.randn(4, 128)
while True:
    loss = engine(x).pow(2).mean()
    engine.backward(loss)
    engine.step()
    engine.save_checkpoint(args.save_dir, tag=f"t{engine.global_steps % 3}")
    if engine.global_rank == 0:
        print(f"saved {engine.global_steps}", flush=True)
