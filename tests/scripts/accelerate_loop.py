"""accelerate's own DeepSpeed path, ``Accelerator(deepspeed_plugin=DeepSpeedPlugin(...))``, with a
client ``torch.optim.AdamW`` and a plain loop, at ZeRO-2 and ZeRO-3 (gradient accumulation 2,
clipping 1.0), checked against one-process training on every rank's batches.

    python accelerate_loop.py --report FILE     (under a 2-process launcher)
"""
import argparse
import json

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.state import AcceleratorState, PartialState
from accelerate.utils import DeepSpeedPlugin

STEPS, GAS, LR = 4, 2, 1e-2


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def data():
    g = torch.Generator().manual_seed(5)
    return torch.utils.data.TensorDataset(torch.randn(64, 6, generator=g), torch.randn(64, 3, generator=g))


def train(stage: int) -> dict:
    plugin = DeepSpeedPlugin(zero_stage=stage, gradient_accumulation_steps=GAS, gradient_clipping=1.0,
                             zero3_init_flag=False, zero3_save_16bit_model=True)
    PartialState(cpu=True)  # on a CPU-only machine: the gloo world of every process (what use_cpu=True does)
    acc = Accelerator(deepspeed_plugin=plugin)
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    loader = torch.utils.data.DataLoader(data(), batch_size=2, shuffle=False)
    model, opt, loader = acc.prepare(model, opt, loader)
    seen, losses = [], []
    for i, (x, y) in enumerate(loader):
        if i == STEPS * GAS:
            break
        with acc.accumulate(model):
            loss = torch.nn.functional.mse_loss(model(x), y)
            acc.backward(loss)
            opt.step()
            opt.zero_grad()
        seen.append((x, y))
        losses.append(loss.item())
    state = acc.get_state_dict(model)  # whole weights on rank 0 (ZeRO-3 gathers them)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, seen)
    out = {"engine": type(model).__module__ + "." + type(model).__name__, "stage": model.zero_optimization_stage(),
           "steps": model.global_steps, "losses": losses}
    if acc.is_main_process:
        ref = make_model()
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR)
        ref_losses = []
        for step in range(STEPS):  # every rank's GAS micro-batches of this step, averaged
            batch = [b for rank_seen in everyone for b in rank_seen[step * GAS:(step + 1) * GAS]]
            ref_opt.zero_grad()
            per = [torch.nn.functional.mse_loss(ref(x), y) for x, y in batch]
            ref_losses.append([p.item() for p in per])
            (sum(per) / len(per)).backward()
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
            ref_opt.step()
        out["max_weight_diff"] = max((state[k].float() - v).abs().max().item() for k, v in ref.state_dict().items())
        out["ref_rank0_losses"] = [ls[j] for ls in ref_losses for j in range(GAS)]  # rank 0's micro-batches
    AcceleratorState._reset_state(True)  # the next case gets a fresh Accelerator (a test-only step)
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--report", required=True)
    p.add_argument("--local_rank", type=int, default=-1)
    a = p.parse_args()
    report = {f"zero{stage}": train(stage) for stage in (2, 3)}
    if dist.get_rank() == 0:
        with open(a.report, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
