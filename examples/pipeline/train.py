"""A two-layer classifier trained with pipeline parallelism (DeepSpeed's pipeline example).

    shardwise run --num_procs 2 examples/pipeline/train.py               # 2 stages, fp16
    shardwise run --num_procs 2 examples/pipeline/train.py --own-loader  # train_batch(data_iter=...)
    python examples/pipeline/train.py --num-stages 1                     # the same layers, no pipeline

With DeepSpeed the script is the same but for the first import (``import deepspeed``).
The data are 784-pixel "images": one of ten random prototypes blended with noise, so the loss
visibly falls within a few dozen steps and nothing is downloaded.
"""

import argparse
import json

import torch

import shardwise as deepspeed
from shardwise.pipe import LayerSpec, PipelineModule
from shardwise.utils import RepeatingLoader


class SimpleLayer(torch.nn.Module):
    def __init__(self, n_in, n_out):
        super().__init__()
        self.fc = torch.nn.Linear(n_in, n_out)

    def forward(self, x):
        return self.fc(torch.relu(x.flatten(1)))


def make_dataset(n=2048, seed=0):
    g = torch.Generator().manual_seed(seed)
    prototypes = torch.rand(10, 784, generator=g)
    labels = torch.randint(0, 10, (n,), generator=g)
    images = (prototypes[labels] + torch.rand(n, 784, generator=g)) / 2
    return torch.utils.data.TensorDataset(images, labels)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--num-stages", type=int, default=2)
    parser.add_argument("--fp32", action="store_true", help="train in fp32 instead of fp16")
    parser.add_argument("--own-loader", action="store_true", help="pass train_batch(data_iter=...)")
    parser.add_argument("--local_rank", type=int, default=-1)
    args = parser.parse_args()

    deepspeed.init_distributed(dist_backend="gloo")
    config = {
        "train_batch_size": 8,
        "gradient_accumulation_steps": 4,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
        "pipeline": {"activation_checkpoint_interval": 1},
        "fp16": {"enabled": not args.fp32, "initial_scale_power": 8},
        "steps_per_print": 10,
    }
    model = PipelineModule(
        layers=[LayerSpec(SimpleLayer, 784, 128), LayerSpec(SimpleLayer, 128, 10)],
        loss_fn=torch.nn.CrossEntropyLoss(),
        num_stages=args.num_stages,
        partition_method="uniform",
        seed_layers=True,
    )
    dataset = make_dataset()
    engine, _, _, _ = deepspeed.initialize(
        config=config, model=model, model_parameters=model.parameters(),
        training_data=None if args.own_loader else dataset,
    )
    data_iter = None
    if args.own_loader:
        loader = engine.deepspeed_io(dataset)  # or any DataLoader of (inputs, labels) batches
        data_iter = iter(RepeatingLoader(loader))

    losses = []
    for _ in range(args.steps):
        loss = engine.train_batch(data_iter=data_iter)
        losses.append(round(float(loss), 6))
    if deepspeed.comm.get_rank() == 0:
        print("LOSSES " + json.dumps(losses), flush=True)


if __name__ == "__main__":
    main()
