"""ZeRO-3 with frozen parameters and checkpointing, on small torch models (the Hugging Face and peft
set-ups are in test_finetune_matrix.py):

* a unit holding a frozen weight and trainable adapter matrices (a peft ``lora.Linear`` in one unit): its
  adapters' gradients arrive before autograd computes the input's gradient through the frozen weight,
  which must still be gathered then; without, with reentrant and with non-reentrant checkpointing;
* a parent's frozen parameter needed for a child's trainable gradient (``child(x * self.scale)``);
* a unit larger than the model: the loss comes back as a tensor that may be changed in place;
* every frozen unit is released in backward once its uses are done (not left gathered after a
  recompute), and after the step nothing is gathered.
Each case trains as one process does (fp32, losses to rtol 1e-6).
"""
from __future__ import annotations

import torch
import torch.nn as nn

from distributed import run_distributed, run_subtests

D = 12


class Adapted(nn.Module):
    """A frozen linear map plus a trainable low-rank one (what peft's ``lora.Linear`` computes)."""

    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Linear(D, D)
        self.base.requires_grad_(False)
        self.a = nn.Linear(D, 2, bias=False)
        self.b = nn.Linear(2, D, bias=False)

    def forward(self, x):
        return self.base(x) + self.b(self.a(x))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = Adapted()
        self.frozen_mid = nn.Linear(D, D)
        self.frozen_mid.requires_grad_(False)
        self.out = Adapted()

    def forward(self, x):
        return x + self.out(torch.tanh(self.frozen_mid(torch.tanh(self.inp(x)))))


class Net(nn.Module):
    def __init__(self, ckpt: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Linear(5, D)  # trainable: the first block's input needs a gradient
        self.scale = nn.Parameter(torch.rand(D) + 0.5, requires_grad=False)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(D, 3)
        self.ckpt = ckpt
        self.late: list = []

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        h = self.emb(x) * self.scale  # (a frozen parameter of the root used toward trainable gradients)
        for block in self.blocks:
            h = block(h) if self.ckpt == "none" else checkpoint(block, h, use_reentrant=self.ckpt == "reentrant")
        return self.head(h)


def _data(steps: int, batch: int):
    g = torch.Generator().manual_seed(3)
    return torch.randn(steps, batch, 5, generator=g), torch.randn(steps, batch, 3, generator=g)


def _reference(ckpt: str, steps: int, batch: int) -> list[float]:
    model = Net("none")
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.01)
    x, y = _data(steps, batch)
    losses = []
    for s in range(steps):
        loss = ((model(x[s]) - y[s]) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _case(case: tuple, rank: int, world: int) -> dict:
    import torch.distributed as dist

    import shardwise

    ckpt, unit = case
    model = Net(ckpt)
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0,
            "stage3_prefetch_bucket_size": {"adapter": 2 * D * D, "tiny": 8, "big": 5e7}[unit]}
    engine, *_ = shardwise.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}}, "zero_optimization": zero})
    units = engine.strategy.units
    late = []

    def record(grad):  # backward reached the first block's input: the second block is done with
        late.extend(u.names[0] for u in units if u.gathered and any(".1." in n for n in u.names))

    x, y = _data(3, 2 * world)
    losses = []
    for s in range(3):
        mine = slice(rank * 2, rank * 2 + 2)
        h = engine.module.emb  # (the first block's input: hook its gradient)
        handle = h.register_forward_hook(lambda m, i, o: [o.register_hook(record)] and None)
        loss = ((engine(x[s, mine]) - y[s, mine]) ** 2).mean()
        handle.remove()
        loss *= world  # in place on the engine's output
        engine.backward(loss / world)
        engine.step()
        loss = loss.detach() / world
        dist.all_reduce(loss)
        losses.append(loss.item() / world)
    gathered = [u.names[0] for u in units if u.gathered and not u.persistent]
    full = [n for u in units for n, p in zip(u.names, u.params) if p.data.numel()]
    return {"losses": losses, "late": late if unit != "big" else [], "gathered": gathered, "full": full,
            "units": len(units)}


def _body(rank: int, world: int, cases: list) -> list:
    return run_subtests(_case, cases, rank, world)


CASES = [(ckpt, unit) for ckpt in ("none", "reentrant", "nonreentrant") for unit in ("adapter", "tiny", "big")]


def test_frozen_weights_stay_until_their_backward_is_done_and_go_after():
    ref = _reference("none", 3, 4)
    results = run_distributed(_body, 2, args=(CASES,), timeout=300)
    for rank_results in results:
        for case, got in zip(CASES, rank_results):
            torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref), rtol=1e-6, atol=0,
                                       msg=lambda m: f"{case}: {m}")
            assert got["late"] == [], (case, got["late"])  # released in backward, frozen ones too
            assert got["gathered"] == [] and got["full"] == [], (case, got)  # partitioned after the step
            if case[1] == "big":
                assert got["units"] == 1, case  # (the whole model one unit: the loss is its output)
