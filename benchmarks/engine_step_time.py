"""Step time of the training engine on the reference GPT (shardwise.models.gpt) for each parallelism, two
ranks each: ZeRO 0, 1, 2, 3 (data 2), pipe 2 (ZeRO-1), tensor 2 (ZeRO-1), MoE ep 2 (data 2, ZeRO-2).

    python benchmarks/engine_step_time.py [--rounds 4] [--steps 10] [--trees DIR_A DIR_B]

``--trees``: the checkouts whose ``shardwise`` is timed (default: this one), e.g. two worktrees for a
before/after table. Each (tree, configuration) is a fresh ``torchrun`` job of two CPU ranks over gloo (one
intra-op thread per rank) with that tree first on ``PYTHONPATH``; the workers use only the public API
(``initialize``, ``forward``/``backward``/``step``, ``train_batch``). Rounds alternate the trees' order
(A B, B A, ...), configurations run in the same order within a round. A configuration's time is the median
over rounds of its slowest rank's median step (``--steps`` steps after one warm-up step); one step is one
optimizer step of 2 micro-batches. The first loss is printed per tree: the same model, data and seed must
give the same loss in every tree.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = [  # name, ZeRO stage, pipe, tensor, expert-parallel size
    ("ZeRO-0", 0, 1, 1, 0),
    ("ZeRO-1", 1, 1, 1, 0),
    ("ZeRO-2", 2, 1, 1, 0),
    ("ZeRO-3", 3, 1, 1, 0),
    ("pipe 2 (ZeRO-1)", 1, 2, 1, 0),
    ("tensor 2 (ZeRO-1)", 1, 1, 2, 0),
    ("MoE ep 2 (ZeRO-2)", 2, 1, 1, 2),
]
WORLD = 2


# ------------------------------------------------------------------------------------------ worker
def _batch(step: int, args):
    import torch

    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, args.vocab, (args.rows, args.seq + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _moe_gpt(cfg, ep: int):
    """The reference GPT with an MoE MLP (4 experts, top-1) between its blocks and its head."""
    import torch

    from shardwise.models.gpt import GPT, gpt_loss
    from shardwise.moe.layer import MoE

    class MoEGPT(torch.nn.Module):
        def __init__(self):
            super().__init__()
            layers = list(GPT(cfg))
            self.body = torch.nn.Sequential(*layers[:-1])
            self.head = layers[-1]
            torch.manual_seed(7)
            h = cfg.hidden
            expert = torch.nn.Sequential(torch.nn.Linear(h, 4 * h), torch.nn.GELU(), torch.nn.Linear(4 * h, h))
            self.moe = MoE(h, expert, num_experts=4, ep_size=ep, k=1, min_capacity=0, drop_tokens=False)

        def forward(self, tokens, labels):
            x = self.body(tokens)
            out, l_aux, _ = self.moe(x)
            return gpt_loss(self.head(x + out), labels) + 0.01 * l_aux

    return MoEGPT()


def _engine(args):
    import torch

    import shardwise
    from shardwise.models.gpt import GPT, GPTConfig, gpt_pipeline_module

    cfg = GPTConfig(vocab_size=args.vocab, seq_len=args.seq, hidden=args.hidden, n_layers=args.layers,
                    n_heads=args.heads)
    data = WORLD // (args.pipe * args.tensor)
    ds = {"train_batch_size": args.rows, "gradient_accumulation_steps": 2,
          "train_micro_batch_size_per_gpu": args.rows // 2 // data, "steps_per_print": 10**9,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
          "zero_optimization": {"stage": args.zero, "stage3_param_persistence_threshold": 0}}
    if args.pipe > 1:
        model = gpt_pipeline_module(cfg, num_stages=args.pipe, partition_method="uniform")
        return shardwise.initialize(model=model, config=ds)[0]
    if args.tensor > 1:
        from shardwise.parallel_dims import ParallelDims
        from shardwise.topology import ParallelGrid

        grid = ParallelGrid.from_dims(ParallelDims(data=data, tensor=args.tensor))
        with grid.active():  # the GPT's tensor-parallel layers cut themselves over this grid
            model = GPT(cfg)
        return shardwise.initialize(model=model, mpu=grid, config=ds)[0]
    if args.ep > 1:
        from shardwise.moe.utils import split_params_into_different_moe_groups_for_optimizer as split

        model = _moe_gpt(cfg, args.ep)
        del ds["optimizer"]
        opt = torch.optim.AdamW(split({"params": list(model.parameters()), "name": "p"}), lr=1e-3)
        return shardwise.initialize(model=model, optimizer=opt, config=ds)[0]
    return shardwise.initialize(model=GPT(cfg), config=ds)[0]


def worker(args) -> None:
    import torch

    import shardwise

    torch.set_num_threads(1)
    shardwise.init_distributed()
    engine = _engine(args)
    grid = engine.grid
    data = WORLD // (args.pipe * args.tensor)
    d = grid.get_data_parallel_rank()
    per = args.rows // data // 2
    times, losses = [], []
    for step in range(args.steps + 1):
        x, y = _batch(step, args)
        mine = [(x[(d * 2 + m) * per:(d * 2 + m + 1) * per], y[(d * 2 + m) * per:(d * 2 + m + 1) * per])
                for m in range(2)]
        torch.distributed.barrier()
        t0 = time.perf_counter()
        if args.pipe > 1:
            loss = float(engine.train_batch(iter(mine)))
        else:
            total = torch.zeros(())
            for xm, ym in mine:
                out = engine(xm, ym)
                engine.backward(out)
                engine.step()
                total += out.detach() / 2 / data
            torch.distributed.all_reduce(total, group=grid.get_data_parallel_group())
            loss = float(total)
        torch.distributed.barrier()
        losses.append(loss)
        if step:
            times.append(time.perf_counter() - t0)
    row = {"step_s": statistics.median(times) if times else 0.0, "loss0": losses[0],
           "file": shardwise.__file__}
    rows = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(rows, row)
    if torch.distributed.get_rank() == 0:
        print("RESULT " + json.dumps(rows), flush=True)


# ------------------------------------------------------------------------------------------ driver
def launch(args, tree: str, zero: int, pipe: int, tensor: int, ep: int) -> list[dict]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(WORLD),
           os.path.abspath(__file__), "--worker", "--zero", str(zero), "--pipe", str(pipe), "--tensor", str(tensor),
           "--ep", str(ep), "--steps", str(args.steps), "--layers", str(args.layers), "--hidden", str(args.hidden),
           "--heads", str(args.heads), "--seq", str(args.seq), "--rows", str(args.rows), "--vocab", str(args.vocab)]
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.path.abspath(tree) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False, cwd=os.path.abspath(tree))
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        sys.exit(f"{tree}: zero {zero} pipe {pipe} tensor {tensor} ep {ep} failed:\n{out.stdout[-3000:]}\n"
                 f"{out.stderr[-3000:]}")
    rows = json.loads(line[len("RESULT "):])
    want = os.path.join(os.path.abspath(tree), "shardwise")
    if not rows[0]["file"].startswith(want):
        sys.exit(f"the workers imported {rows[0]['file']}, not the shardwise of {tree}")
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--trees", nargs="+", default=[ROOT])
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--only", nargs="*", default=None, help="configuration names to run (default: all)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--zero", type=int, default=0)
    p.add_argument("--pipe", type=int, default=1)
    p.add_argument("--tensor", type=int, default=1)
    p.add_argument("--ep", type=int, default=0)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    configs = [c for c in CONFIGS if args.only is None or c[0] in args.only]
    times = {(t, c[0]): [] for t in args.trees for c in configs}
    loss0 = {}
    for r in range(args.rounds):
        for tree in (args.trees if r % 2 == 0 else args.trees[::-1]):
            for name, zero, pipe, tensor, ep in configs:
                rows = launch(args, tree, zero, pipe, tensor, ep)
                times[(tree, name)].append(max(row["step_s"] for row in rows))
                loss0[(tree, name)] = rows[0]["loss0"]
    print(f"reference GPT hidden {args.hidden}, {args.layers} layers, {args.heads} heads, seq {args.seq}, "
          f"{args.rows} sequences per step (2 micro-batches), AdamW, {WORLD} CPU ranks (gloo), "
          f"{args.rounds} rounds, median of {args.steps} steps\n")
    names = [os.path.basename(os.path.abspath(t)) for t in args.trees]
    print("| configuration | " + " | ".join(f"{n}: step (ms)" for n in names) +
          (f" | {names[-1]} / {names[0]}" if len(names) > 1 else "") + " | first loss |")
    print("|---|" + "---|" * len(names) + ("---|" if len(names) > 1 else "") + "---|")
    for name, *_ in configs:
        ms = [statistics.median(times[(t, name)]) * 1e3 for t in args.trees]
        ratio = f" | {ms[-1] / ms[0]:.3f}" if len(ms) > 1 else ""
        losses = sorted({f"{loss0[(t, name)]:.6f}" for t in args.trees})
        print(f"| {name} | " + " | ".join(f"{m:.1f}" for m in ms) + ratio + f" | {' / '.join(losses)} |")


if __name__ == "__main__":
    main()
