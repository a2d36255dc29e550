"""Tiny models and data shared by the engine tests."""

from __future__ import annotations

import torch
import torch.nn as nn


class TinyMLP(nn.Module):
    """Odd sizes (numel not divisible by 2 or 4), a frozen parameter and an unused one."""

    def __init__(self, d_in: int = 7, hidden: int = 13, d_out: int = 3) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.out = nn.Linear(hidden, d_out)
        self.frozen = nn.Parameter(torch.randn(hidden), requires_grad=False)
        self.unused = nn.Parameter(torch.randn(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc1(x))
        h = torch.tanh(self.fc2(h) + self.frozen)
        return self.out(h)


def make_model(seed: int = 0) -> TinyMLP:
    torch.manual_seed(seed)
    return TinyMLP()


def make_data(steps: int, global_batch: int, seed: int = 1, d_in: int = 7, d_out: int = 3):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(steps, global_batch, d_in, generator=g)
    y = torch.randn(steps, global_batch, d_out, generator=g)
    return x, y


def mse(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((pred.float() - target.float()) ** 2).mean()


def base_config(**overrides) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
        "zero_optimization": {"stage": 0, "reduce_bucket_size": 64},
    }
    cfg.update(overrides)
    return cfg


def zero_fill_grads(model: nn.Module) -> None:
    """Unused trainable parameters get a zero gradient, as in DeepSpeed's data parallelism
    (so weight decay still applies to them)."""
    for p in model.parameters():
        if p.requires_grad and p.grad is None:
            p.grad = torch.zeros_like(p)


def reference_training(steps: int, global_batch: int, *, clip: float = 0.0, lr: float = 1e-2, wd: float = 0.01):
    """Single-process plain-PyTorch training of ``make_model()`` on the whole global batch."""
    return reference_training_for(make_model(), steps, global_batch, clip=clip, lr=lr, wd=wd)


class TiedModel(nn.Module):
    """Tied weights (one Parameter in two modules), a module called twice per forward, a parameter
    used functionally by the root module (external to its owner), a frozen and an unused one."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Linear(7, 13)
        self.shared = nn.Linear(13, 13)
        self.proj = nn.Linear(13, 13, bias=False)
        self.proj2 = nn.Linear(13, 13, bias=False)
        self.proj2.weight = self.proj.weight
        self.out = nn.Linear(7, 3)
        self.frozen = nn.Parameter(torch.randn(13), requires_grad=False)
        self.unused = nn.Parameter(torch.randn(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.emb(x))
        h = torch.tanh(self.shared(h))
        h = torch.tanh(self.shared(h) + self.frozen)
        h = torch.tanh(self.proj2(torch.tanh(self.proj(h))))
        h = h @ self.emb.weight  # functional use of emb's weight outside emb's forward
        return self.out(h)


def make_tied_model(seed: int = 0) -> TiedModel:
    torch.manual_seed(seed)
    return TiedModel()


def reference_training_for(model: nn.Module, steps: int, global_batch: int, *, clip: float = 0.0,
                           lr: float = 1e-2, wd: float = 0.01):
    """Single-process training of ``model`` on the whole global batch (as ``reference_training``)."""
    x, y = make_data(steps, global_batch)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=wd)
    losses = []
    for s in range(steps):
        loss = mse(model(x[s]), y[s])
        opt.zero_grad()
        loss.backward()
        zero_fill_grads(model)
        if clip > 0:
            torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], clip)
        opt.step()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}
