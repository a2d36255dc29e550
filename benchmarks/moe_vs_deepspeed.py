"""DeepSpeed's MoE layer, trained by shardwise and by DeepSpeed 0.19.8: the same losses, step by step.

    python benchmarks/moe_vs_deepspeed.py [--dsvenv /work/ds-venv] [--world 4] [--steps 3]

One script, run twice with 4 processes (torchrun, gloo, CPU): ``import deepspeed`` under ``--dsvenv``
(``DS_ACCELERATOR=cpu``) and ``import shardwise as deepspeed`` from this checkout. It builds a small
model around ``deepspeed.moe.layer.MoE`` (4 experts, each a distinct MLP) and trains it for a few steps
for every combination of ep_size 1/2/4, ZeRO stage 0/1/2 and gate: top-2 with token dropping (capacity
factor 1, Gumbel sampling of the second expert), top-2 dropless, top-1 with random token selection and
dropping, top-1 with RSample noise, top-1 with Jitter noise and a residual MLP, top-3 with dropping
(``--gates`` picks some). Every rank seeds its RNG alike in both runs, so the gates draw the same
noise. With ``--clip`` above 0 (the default) DeepSpeed's ZeRO-0 step clips by the mean over the data
ranks of each rank's own norm (its dense and local expert gradients), shardwise by the norm of the whole
model (each expert counted once): those cases differ by about 1e-5 after a few steps; with ``--clip 0`` or
at ZeRO 1-2 they agree to float rounding. Printed: the largest relative difference of the per-rank
losses per case (exit status 1 above ``--rtol``). This is a manual check (DeepSpeed is no dependency of shardwise or its tests); the numbers
from the last run are in docs/moe.md.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HIDDEN, EXPERTS = 16, 4
GATES = {"top2-drop": dict(k=2, capacity_factor=1.0, drop_tokens=True),
         "top2-dropless": dict(k=2, capacity_factor=1.0, drop_tokens=False),
         "top1-rts-drop": dict(k=1, capacity_factor=1.0, drop_tokens=True, use_rts=True),
         "top1-rsample": dict(k=1, capacity_factor=2.0, drop_tokens=True, noisy_gate_policy="RSample"),
         "top1-jitter-residual": dict(k=1, capacity_factor=2.0, noisy_gate_policy="Jitter", use_residual=True),
         "top3-drop": dict(k=3, capacity_factor=1.0, drop_tokens=True)}


def _cases(gates):
    return [(ep, stage, gate) for ep in (1, 2, 4) for stage in (0, 1, 2) for gate in gates]


def worker(args) -> None:
    import torch

    torch.set_num_threads(1)
    if args.framework == "deepspeed":
        import deepspeed
    else:
        sys.path.insert(0, ROOT)
        import shardwise as deepspeed
    package = "deepspeed" if args.framework == "deepspeed" else "shardwise"
    MoE = importlib.import_module(f"{package}.moe.layer").MoE
    split_params_into_different_moe_groups_for_optimizer = importlib.import_module(
        f"{package}.moe.utils").split_params_into_different_moe_groups_for_optimizer

    class Net(torch.nn.Module):
        def __init__(self, ep, gate):
            super().__init__()
            self.inp = torch.nn.Linear(HIDDEN, HIDDEN)
            expert = torch.nn.Sequential(torch.nn.Linear(HIDDEN, 2 * HIDDEN), torch.nn.GELU(),
                                         torch.nn.Linear(2 * HIDDEN, HIDDEN))
            self.moe = MoE(HIDDEN, expert, num_experts=EXPERTS, ep_size=ep, min_capacity=1, **GATES[gate])
            self.out = torch.nn.Linear(HIDDEN, 1)

        def forward(self, x, y):
            h, l_aux, _ = self.moe(torch.tanh(self.inp(x)))
            return torch.nn.functional.mse_loss(self.out(h).squeeze(-1), y) + 0.01 * l_aux

    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    results = {}
    for ep, stage, gate in _cases(args.gates):
        torch.manual_seed(0)
        net = Net(ep, gate)
        local = EXPERTS // ep
        with torch.no_grad():  # global expert e: weights from seed 100 + e
            for j, expert in enumerate(net.moe.deepspeed_moe.experts.deepspeed_experts):
                g = torch.Generator().manual_seed(100 + (rank % ep) * local + j)
                for p in expert.parameters():
                    p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        groups = split_params_into_different_moe_groups_for_optimizer({"params": list(net.parameters()),
                                                                       "name": "params"})
        opt = torch.optim.AdamW(groups, lr=0.01)
        engine, *_ = deepspeed.initialize(model=net, optimizer=opt, config={
            "train_micro_batch_size_per_gpu": 2, "gradient_clipping": args.clip, "steps_per_print": 1000,
            "zero_optimization": {"stage": stage}})
        torch.manual_seed(1234 + rank)
        losses = []
        for step in range(args.steps):
            g = torch.Generator().manual_seed(1000 + step)
            x = torch.rand(world, 2, args.tokens, HIDDEN, generator=g)[rank]
            y = torch.randn(world, 2, args.tokens, generator=g)[rank]
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            losses.append(float(loss))
        results[f"ep{ep}-zero{stage}-{gate}"] = losses
    with open(os.path.join(args.out, f"{args.framework}-{rank}.json"), "w") as f:
        json.dump(results, f)


def launch(args) -> int:
    out = args.out or tempfile.mkdtemp(prefix="moe_vs_ds_")
    runs = [("deepspeed", os.path.join(args.dsvenv, "bin", "torchrun")),
            ("shardwise", os.path.join(os.path.dirname(sys.executable), "torchrun"))]
    for framework, torchrun in runs:
        if framework == "deepspeed" and args.out and os.path.exists(os.path.join(out, "deepspeed-0.json")):
            continue  # --out of an earlier run: its DeepSpeed losses are kept
        env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
        if framework == "shardwise":
            env["PYTHONPATH"] = ROOT
        cmd = [torchrun, "--standalone", f"--nproc_per_node={args.world}", os.path.abspath(__file__), "--worker",
               "--framework", framework, "--out", out, "--steps", str(args.steps), "--tokens", str(args.tokens),
               "--clip", str(args.clip), "--gates", *args.gates]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            print(f"{framework} failed:\n{done.stderr[-4000:]}")
            return 2
    worst = 0.0
    print(f"{'case':<28} {'max rel. loss diff':>20}   deepspeed losses (rank 0)")
    for case in json.load(open(os.path.join(out, "deepspeed-0.json"))):
        diff = 0.0
        for r in range(args.world):
            ds = json.load(open(os.path.join(out, f"deepspeed-{r}.json")))[case]
            sw = json.load(open(os.path.join(out, f"shardwise-{r}.json")))[case]
            diff = max([diff] + [abs(a - b) / max(abs(a), 1e-12) for a, b in zip(ds, sw)])
        worst = max(worst, diff)
        ds0 = json.load(open(os.path.join(out, "deepspeed-0.json")))[case]
        print(f"{case:<28} {diff:>20.2e}   {' '.join(f'{v:.6f}' for v in ds0)}")
    print(f"worst: {worst:.2e} (rtol {args.rtol:g})")
    return 0 if worst <= args.rtol else 1


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dsvenv", default="/work/ds-venv")
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--clip", type=float, default=0.05, help="gradient_clipping (0: off)")
    ap.add_argument("--gates", nargs="+", default=list(GATES), choices=list(GATES))
    ap.add_argument("--rtol", type=float, default=1e-5)
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--framework", choices=["deepspeed", "shardwise"])
    ap.add_argument("--out", help="results folder (an earlier run's: its DeepSpeed losses are reused)")
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return 0
    return launch(args)


if __name__ == "__main__":
    sys.exit(main())
