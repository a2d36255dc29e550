"""Expert parallelism: tokens/s of ep 2 and ep 4 (ZeRO-2 and ZeRO-3) against the same model with replicated
experts (ep 1, ZeRO-2) and against the leaf-module approach under ZeRO-3 (a Hugging Face-style block calling
each expert on its tokens in a Python loop, marked a leaf: every rank gathers every expert), and the
all-to-all bytes per step against the formula.

    python benchmarks/moe.py [--world 4] [--hidden 256] [--experts 8] [--layers 2] [--tokens 512] \\
        [--steps 6] [--rounds 2] [--dsvenv /work/ds-venv | --no-deepspeed]

Each configuration runs in ``--world`` processes (gloo, CPU, one thread each): a stack of ``--layers``
blocks, each ``DeepSpeed MoE(num_experts=--experts, k=2, dropless)`` around an MLP expert of width
4 x hidden, trained with Adam on ``--tokens`` tokens per rank and step; the leaf row replaces each MoE
by that loop block (same gate and experts: softmax top-2, dropless). The configurations
take turns (A B C A B C ...) for ``--rounds`` rounds; reported per configuration: the median step
time after one warm-up step (best round), tokens/s over the whole world, the ratio to ep 1, and the
bytes one rank handed to ``all_to_all_single`` per step (counted) against
``layers x 4 x experts x capacity x hidden x 4 bytes`` (``shardwise.moe.sharded_moe.all_to_all_bytes``,
with each step's capacity as the gate chose it).

DeepSpeed's native MoE rows (ep 1, 2, 4 at ZeRO-2; DeepSpeed refuses its MoE at ZeRO-3) train the same model
built with ``deepspeed.moe.layer.MoE`` under ``deepspeed.initialize``, ``--world`` processes launched with
``<--dsvenv>/bin/torchrun`` (``DS_ACCELERATOR=cpu``), taking their turn in the same rounds; their all-to-all
bytes are counted at ``deepspeed.comm.all_to_all_single`` (no formula column: DeepSpeed does not expose
the capacity it chose).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))


def _net(args, MoE, split, *, ep: int, leaf: bool):
    """The model and its Adam optimizer, built with either framework's ``MoE`` and param-group split."""
    import torch

    h = args.hidden

    def mlp():
        return torch.nn.Sequential(torch.nn.Linear(h, 4 * h), torch.nn.GELU(), torch.nn.Linear(4 * h, h))

    class LoopMoE(torch.nn.Module):  # Mixtral's block before fused experts: only the chosen experts run
        def __init__(self):
            super().__init__()
            self.gate = torch.nn.Linear(h, args.experts, bias=False)
            self.experts = torch.nn.ModuleList(mlp() for _ in range(args.experts))

        def forward(self, x):
            weights, chosen = torch.softmax(self.gate(x), -1).topk(2, -1)
            weights = weights / weights.sum(-1, keepdim=True)
            out = torch.zeros_like(x)
            for e, hit in enumerate(torch.nn.functional.one_hot(chosen, args.experts).permute(2, 1, 0)):
                slot, token = torch.where(hit)
                if token.numel():
                    out = out.index_add(0, token, self.experts[e](x[token]) * weights[token, slot, None])
            return out, 0.0

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.moe = LoopMoE() if leaf else MoE(h, mlp(), num_experts=args.experts, ep_size=ep, k=2,
                                                  drop_tokens=False, min_capacity=0)

        def forward(self, x):
            out, l_aux, *_ = self.moe(x)
            return x + out, l_aux

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = torch.nn.Linear(h, h)  # (so the first block's dispatch has a gradient to send back)
            self.blocks = torch.nn.ModuleList(Block() for _ in range(args.layers))

        def forward(self, x):
            aux = 0.0
            x = self.inp(x)
            for b in self.blocks:
                x, l_aux = b(x)
                aux = aux + l_aux
            return x.pow(2).mean() + 0.01 * aux

    torch.manual_seed(0)
    net = Net()
    return net, torch.optim.Adam(split({"params": list(net.parameters()), "name": "p"}), lr=1e-4)


def _train(engine, rank, args, sent, formula_of):
    """Steps timed (one warm-up); per step the bytes counted into ``sent[0]`` and ``formula_of()``."""
    import torch

    x = torch.randn(args.tokens, args.hidden, generator=torch.Generator().manual_seed(rank))
    times, measured, formula = [], [], []
    for _ in range(args.steps + 1):
        sent[0] = 0
        t0 = time.perf_counter()
        loss = engine(x)
        engine.backward(loss)
        engine.step()
        times.append(time.perf_counter() - t0)
        measured.append(sent[0])
        formula.append(formula_of())
    return {"step_s": statistics.median(times[1:]), "a2a": measured[1:], "formula": formula[1:]}


def _body(rank, world, config, args):
    import torch

    import shardwise
    from shardwise import comm
    from shardwise.comm import autograd as comm_autograd
    from shardwise.moe.layer import MoE
    from shardwise.moe.sharded_moe import all_to_all_bytes
    from shardwise.moe.utils import split_params_into_different_moe_groups_for_optimizer

    torch.set_num_threads(1)
    _, ep, stage, leaf = config
    net, opt = _net(args, MoE, split_params_into_different_moe_groups_for_optimizer, ep=ep, leaf=leaf)
    zero = {"stage": stage}
    if leaf:
        zero["leaf_module"] = {"classes": ["LoopMoE"]}
    engine, *_ = shardwise.initialize(model=net, optimizer=opt, config={
        "train_micro_batch_size_per_gpu": 1, "zero_optimization": zero})
    sent = [0]
    exchange = comm.all_to_all_single

    def counted(output, tensor, *a, **kw):  # the bytes handed to the all-to-all
        sent[0] += tensor.numel() * tensor.element_size()
        return exchange(output, tensor, *a, **kw)

    comm.all_to_all_single = counted
    comm_autograd.all_to_all_single = counted  # (the differentiable row exchange holds its own reference)
    return _train(engine, rank, args, sent, lambda: sum(
        all_to_all_bytes(hidden=args.hidden, num_experts=args.experts, element_bytes=4,
                         capacity=b.moe.deepspeed_moe.last_capacity) for b in net.blocks) if ep > 1 else 0)


def _deepspeed_worker(args) -> None:
    """One rank of a DeepSpeed 0.19.8 row (run by ``_run_deepspeed`` under DeepSpeed's torchrun): the same
    model with ``deepspeed.moe.layer.MoE``, ``deepspeed.initialize``; writes ``<out>/rank<r>.json``."""
    import json

    import torch

    import deepspeed
    from deepspeed import comm as ds_comm
    from deepspeed.moe.layer import MoE
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    rank = ds_comm.get_rank()
    net, opt = _net(args, MoE, split_params_into_different_moe_groups_for_optimizer, ep=args.ds_ep, leaf=False)
    engine, *_ = deepspeed.initialize(model=net, optimizer=opt, config={
        "train_micro_batch_size_per_gpu": 1, "steps_per_print": 10 ** 9, "zero_optimization": {"stage": 2}})
    sent = [0]
    exchange = ds_comm.all_to_all_single

    def counted(output, tensor, *a, **kw):
        sent[0] += tensor.numel() * tensor.element_size()
        return exchange(output, tensor, *a, **kw)

    ds_comm.all_to_all_single = counted  # (deepspeed.moe.sharded_moe calls it through the module)
    out = _train(engine, rank, args, sent, lambda: 0)
    with open(os.path.join(args.ds_out, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)


def _run_deepspeed(ep: int, args) -> list[dict]:
    """A DeepSpeed row: ``--world`` processes under ``<dsvenv>/bin/torchrun`` (``DS_ACCELERATOR=cpu``)."""
    import json
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory(prefix="moe_bench_ds_") as out:
        cmd = [os.path.join(args.dsvenv, "bin", "torchrun"), "--standalone", f"--nproc_per_node={args.world}",
               os.path.abspath(__file__), "--ds-worker", "--ds-ep", str(ep), "--ds-out", out,
               "--hidden", str(args.hidden), "--experts", str(args.experts), "--layers", str(args.layers),
               "--tokens", str(args.tokens), "--steps", str(args.steps)]
        env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
        env.pop("PYTHONPATH", None)
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
        if done.returncode != 0:
            raise RuntimeError(f"DeepSpeed ep {ep} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
        return [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(args.world)]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dsvenv", default="/work/ds-venv", help="a virtualenv with deepspeed==0.19.8 for its rows")
    ap.add_argument("--no-deepspeed", action="store_true", help="leave DeepSpeed's native MoE rows out")
    ap.add_argument("--ds-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--ds-ep", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--ds-out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.ds_worker:
        _deepspeed_worker(args)
        return 0
    from distributed import run_distributed

    eps = [ep for ep in (2, 4) if args.world % ep == 0 and args.experts % ep == 0]
    configs = [("replicated (ep 1), ZeRO-2", 1, 2, None)]  # (label, ep, stage, None / "leaf" / "deepspeed")
    configs += [(f"ep {ep}, ZeRO-{stage}", ep, stage, None) for stage in (2, 3) for ep in eps]
    configs.append(("leaf block, ZeRO-3", 1, 3, "leaf"))
    if not args.no_deepspeed:
        if os.path.exists(os.path.join(args.dsvenv, "bin", "torchrun")):
            configs += [(f"DeepSpeed ep {ep}, ZeRO-2", ep, 2, "deepspeed") for ep in [1] + eps]
        else:
            print(f"(no {args.dsvenv}/bin/torchrun: DeepSpeed's rows left out)")
    best: dict[str, dict] = {}
    for _ in range(args.rounds):
        for config in configs:
            if config[3] == "deepspeed":
                outs = _run_deepspeed(config[1], args)
            else:
                outs = run_distributed(_body, args.world, args=(config[:3] + (config[3] == "leaf",), args),
                                       timeout=1800)
            step = max(o["step_s"] for o in outs)
            if config[0] not in best or step < best[config[0]]["step_s"]:
                best[config[0]] = {**outs[0], "step_s": step}
    base = best[configs[0][0]]["step_s"]
    print(f"world {args.world}, hidden {args.hidden}, {args.experts} experts, {args.layers} MoE layers, "
          f"{args.tokens} tokens/rank/step")
    print(f"{'experts':<26} {'step (s)':>9} {'tokens/s':>10} {'vs ep 1':>8} {'a2a bytes/step':>15} {'formula':>12}")
    status = 0
    for what, ep, _, kind in configs:
        b = best[what]
        a2a = statistics.median(b["a2a"]) if ep > 1 else 0
        formula = f"{statistics.median(b['formula']):.0f}" if ep > 1 and kind != "deepspeed" else "-" if ep > 1 else "0"
        print(f"{what:<26} {b['step_s']:>9.4f} {args.world * args.tokens / b['step_s']:>10.0f} "
              f"{base / b['step_s']:>7.2f}x {a2a:>15.0f} {formula:>12}")
        if ep > 1 and kind != "deepspeed" and b["a2a"] != b["formula"]:
            print(f"  all-to-all bytes differ from the formula: {b['a2a']} vs {b['formula']}")
            status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
