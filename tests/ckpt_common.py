"""Models, data and whole-state snapshots shared by the checkpoint tests."""

from __future__ import annotations

import torch
import torch.nn as nn


class DropoutMLP(nn.Module):
    """Odd sizes, dropout (so the RNG state matters), a frozen parameter and a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(7, 13)
        self.drop = nn.Dropout(0.2)
        self.fc2 = nn.Linear(13, 11)
        self.out = nn.Linear(11, 3)
        self.frozen = nn.Parameter(torch.randn(11), requires_grad=False)
        self.register_buffer("shift", torch.linspace(-0.1, 0.1, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(torch.tanh(self.fc1(x)))
        h = torch.tanh(self.fc2(h) + self.frozen)
        return self.out(h) + self.shift


class IndexedData(torch.utils.data.Dataset):
    """Sample ``i`` is ``(x_i, y_i, i)``, so a test can see which samples each step used."""

    def __init__(self, n: int, seed: int = 3) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 7, generator=g)
        self.y = torch.randn(n, 3, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i], i


def full_params(engine) -> dict[str, torch.Tensor]:
    """Every parameter's whole fp32 (master) value and every buffer. Collective at stages 1-3."""
    from shardwise.utils import safe_get_full_fp32_param

    out = {n: safe_get_full_fp32_param(p).clone() for n, p in engine.module.named_parameters()}
    out.update({n: b.detach().clone() for n, b in engine.module.named_buffers()})
    return out


def snapshot(engine) -> dict:
    """Everything a resume must restore, as comparable values. Collective at stages 1-3."""
    opt = {}
    for name, start, end, t in engine.strategy.local_fragments():
        for k, v in engine.optimizer.state.get(t, {}).items():
            opt[f"{name}@{start}:{end}/{k}"] = v.detach().clone()
    return {
        "params": full_params(engine),
        "model": {k: v.detach().clone() for k, v in engine.strategy.module_state_dict(engine.module).items()},
        "opt": opt,
        "lr": engine.get_lr(),
        "sched": engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None,
        "scaler": engine.loss_scaler.state_dict() if engine.loss_scaler is not None else None,
        "counters": (engine.global_steps, engine.global_samples, engine.micro_steps, engine.skipped_steps),
    }


def assert_same(a: dict, b: dict, what: str = "") -> None:
    """Bitwise equality of two snapshots (or of two dicts of tensors)."""
    assert a.keys() == b.keys(), f"{what}: keys differ: {sorted(set(a) ^ set(b))}"
    for k in a:
        va, vb = a[k], b[k]
        if isinstance(va, dict):
            assert_same(va, vb, f"{what}.{k}")
        elif isinstance(va, torch.Tensor):
            assert va.dtype == vb.dtype and va.shape == vb.shape, f"{what}.{k}: {va.dtype}{tuple(va.shape)} vs " \
                                                                   f"{vb.dtype}{tuple(vb.shape)}"
            assert torch.equal(va, vb), f"{what}.{k} differs (max diff {(va.float() - vb.float()).abs().max()})"
        else:
            assert va == vb, f"{what}.{k}: {va!r} != {vb!r}"
