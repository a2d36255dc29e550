"""Tiny layer lists, data and a one-process reference for the pipeline tests."""
from __future__ import annotations

import torch
from torch import nn

from shardwise.pipe import LayerSpec, TiedLayerSpec
from shardwise.pipe.module import build_sequential

IN, CLASSES = 8, 4


class Lin(nn.Module):
    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.fc = nn.Linear(n_in, n_out)

    def forward(self, x):
        return torch.tanh(self.fc(x))


class Pair(nn.Module):
    """Returns a tuple (two tensors, one integer) to exercise tuple activations."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.fc = nn.Linear(n, n)

    def forward(self, x):
        if isinstance(x, tuple):
            x = x[0] + x[1]
        h = torch.tanh(self.fc(x))
        return h, h * 0.5, torch.arange(h.shape[0])


class Join(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.fc = nn.Linear(n, n)

    def forward(self, x):
        a, b, idx = x
        return torch.tanh(self.fc(a - b)) + 0 * idx.unsqueeze(1)


def layer_specs(tied: bool = False):
    if tied:
        return [TiedLayerSpec("t", Lin, IN, IN, tied_weight_attr="fc.weight"), LayerSpec(Lin, IN, 16), LayerSpec(Lin, 16, 16),
                LayerSpec(Lin, 16, IN), TiedLayerSpec("t", Lin, IN, IN, tied_weight_attr="fc.weight"), LayerSpec(nn.Linear, IN, CLASSES)]
    return [LayerSpec(Lin, IN, 16), LayerSpec(Pair, 16), LayerSpec(Join, 16), LayerSpec(Lin, 16, 16),
            LayerSpec(Lin, 16, IN), LayerSpec(nn.Linear, IN, CLASSES)]


def batch(step: int, micro: int, rows: int):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(micro, rows, IN, generator=g), torch.randint(0, CLASSES, (micro, rows), generator=g)


def reference(*, steps: int, micro: int, rows: int, lr: float = 1e-2, clip: float = 0.0, tied: bool = False,
              model=None):
    """One process, no pipeline: the same layers (same seeds) trained on the whole batches."""
    model = model or build_sequential(layer_specs(tied), seed_layers=True)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    losses = []
    for step in range(steps):
        x, y = batch(step, micro, rows)
        opt.zero_grad()
        total = 0.0
        for i in range(micro):
            loss = nn.functional.cross_entropy(model(x[i]), y[i])
            (loss / micro).backward()
            total += float(loss.detach())
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        losses.append(total / micro)
    return losses, model
