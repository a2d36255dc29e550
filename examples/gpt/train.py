"""Train a small GPT with shardwise, the way a DeepSpeed script does.

    shardwise run --num_procs 2 examples/gpt/train.py --deepspeed --deepspeed_config examples/gpt/ds_config.json
"""

import argparse
import logging
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import shardwise as deepspeed  # noqa: E402  (the one-line change from a DeepSpeed script)
from model import GPT, CharDataset, GPTConfig, lm_loss  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description="shardwise GPT demo")
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the launcher")
    parser.add_argument("--steps", type=int, default=1000, help="optimizer steps")
    parser.add_argument("--save_dir", default="checkpoints/gpt-demo")
    parser.add_argument("--seed", type=int, default=1234)
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    torch.manual_seed(args.seed)
    deepspeed.init_distributed()
    cfg = GPTConfig()
    model = GPT(cfg)
    data = CharDataset(cfg.block_size)
    engine, _, loader, _ = deepspeed.initialize(
        args=args, model=model, model_parameters=model.parameters(), training_data=data
    )
    if engine.global_rank == 0:
        print(f"GPT with {model.num_parameters() / 1e6:.2f}M parameters, {engine.dp_world_size} data-parallel "
              f"ranks, global batch {engine.train_batch_size()} "
              f"({engine.train_micro_batch_size_per_gpu()} per rank x {engine.gradient_accumulation_steps()} "
              f"accumulation), {len(data)} training windows")

    data_iter = iter(deepspeed.RepeatingLoader(loader))
    first = None
    with engine.progress(total=args.steps, desc="gpt-demo"):
        while engine.global_steps < args.steps:
            x, y = next(data_iter)
            loss = lm_loss(engine(x.to(engine.device)), y.to(engine.device))
            engine.backward(loss)
            engine.step()
            if first is None and engine.get_loss() is not None:
                first = engine.get_loss()
    engine.save_checkpoint(args.save_dir, client_state={"steps": engine.global_steps})
    if engine.global_rank == 0:
        print(f"loss {first:.3f} -> {engine.get_loss():.3f} after {engine.global_steps} steps; "
              f"checkpoint saved in {args.save_dir}/global_step{engine.global_steps}")


if __name__ == "__main__":
    main()
