"""Adam vs OneBitAdam vs ZeroOneAdam vs OneBitLamb: bytes on the wire and step time.

    python benchmarks/onebit.py [--worlds 2 4] [--steps 45] [--warmup 20] [--width 4096] [--links loopback 1gbit]

Every optimizer runs at ZeRO stage 0, and Adam and OneBitAdam also at stage 1 (``type:1``).

A communication-heavy model (a wide MLP, 8 samples per rank) trained for ``--steps`` steps with
each optimizer; the compressed ones switch to 1-bit messages after ``--warmup`` steps. Measured
over the steps after warm-up (from step warmup + 5 on), per step:

* message bytes issued by rank 0 (the comms logger, nccl-tests' sizes);
* bytes that really crossed the network interfaces (``/proc/net/dev`` transmit counters, summed
  over every interface of every namespace the ranks run in), divided by the number of ranks;
* rank 0's median step time.

As root, every run gets private network namespaces, so the counters see only this run:
``loopback``: all ranks in one namespace talking over its ``lo``; ``1gbit``: the ranks split over
two namespaces ("nodes") joined by a veth pair shaped with ``tc qdisc ... netem rate 1gbit``
(ranks on one node still talk over ``lo``). Without root only the loopback case runs, in the
machine's own namespace, where other processes' traffic also shows in the ``lo`` counters.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# "type:1": the same optimizer at ZeRO stage 1 (OneBitAdam's partitioned state, docs/onebit.md)
OPTIMIZERS = ("Adam", "OneBitAdam", "ZeroOneAdam", "OneBitLamb", "Adam:1", "OneBitAdam:1")
MICRO = 8


def _params(name: str, warmup: int) -> dict:
    if name == "OneBitAdam":
        return {"freeze_step": warmup}
    if name == "OneBitLamb":
        return {"freeze_step": warmup, "lr": 1e-2}  # LAMB's steps are relative to the weights: a larger lr
    if name == "ZeroOneAdam":  # local steps synchronised every 4 steps once past var_freeze_step
        return {"var_freeze_step": warmup, "var_update_scaler": 4, "local_step_scaler": 4, "local_step_clipper": 4}
    return {}


def _tx_bytes() -> int:
    """Bytes transmitted by every interface of this network namespace."""
    total = 0
    with open("/proc/net/dev") as f:
        for line in f.readlines()[2:]:
            fields = line.split(":", 1)[1].split()
            total += int(fields[8])
    return total


# ----------------------------------------------------------------------------- one rank

def worker(args) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR=args.master, MASTER_PORT=str(args.port), RANK=str(args.rank),
                      WORLD_SIZE=str(args.world), LOCAL_RANK=str(args.local_rank))
    torch.set_num_threads(1)
    sys.path.insert(0, ROOT)
    import shardwise
    from shardwise import comm

    torch.manual_seed(0)
    d, width = 256, args.width
    model = torch.nn.Sequential(torch.nn.Linear(d, width), torch.nn.Tanh(), torch.nn.Linear(width, width // 4),
                                torch.nn.Tanh(), torch.nn.Linear(width // 4, d))
    opt, _, stage = args.opt.partition(":")
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_clipping": 0.0,
           "optimizer": {"type": opt, "params": {"lr": 1e-3, **_params(opt, args.warmup)}},
           "zero_optimization": {"stage": int(stage or 0)}, "comms_logger": {"enabled": True}}
    engine, *_ = shardwise.initialize(model=model, config=cfg)
    g = torch.Generator().manual_seed(1 + args.rank)
    teacher = torch.Generator().manual_seed(0)
    w_true = torch.randn(d, d, generator=teacher) / d**0.5
    start = args.warmup + 5
    times, losses = [], []
    tx0 = 0
    for step in range(args.steps):
        if step == start:
            dist.barrier()
            comm.reset_comms_log()
            tx0 = _tx_bytes()
        x = torch.randn(MICRO, d, generator=g)
        t0 = time.perf_counter()
        loss = ((engine(x) - x @ w_true) ** 2).mean()
        engine.backward(loss)
        engine.step()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    logged = comm.comms_summary()
    dist.barrier()
    tx = _tx_bytes() - tx0
    measured = args.steps - start
    out = {"step_ms": statistics.median(times[start:]) * 1e3,
           "logged_bytes": sum(size * s["count"] for sizes in logged.values() for size, s in sizes.items()) / measured,
           "tx_bytes": tx / measured, "loss": sum(losses[-5:]) / 5,
           "ops": {op: sorted(sizes) for op, sizes in logged.items()},
           "params": sum(p.numel() for p in model.parameters())}
    with open(args.out, "w") as f:
        json.dump(out, f)
    comm.destroy_process_group()


# ----------------------------------------------------------------------------- namespaces

def _sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, timeout=30)


def _shape(ns: str, dev: str, rate: str) -> str:
    """``tc qdisc add ... netem rate``; kernels without sch_netem get a token bucket (tbf) at the same rate."""
    tc = ["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root"]
    try:
        _sh(*tc, "netem", "rate", rate)
        return f"netem rate {rate}"
    except subprocess.CalledProcessError:
        _sh(*tc, "tbf", "rate", rate, "burst", "64kb", "latency", "50ms")
        return f"tbf rate {rate} burst 64kb (no netem in this kernel)"


class Namespaces:
    """``count`` network namespaces (1: loopback only; 2: joined by a veth pair shaped to ``rate``)."""

    def __init__(self, count: int, rate: str | None) -> None:
        tag = os.getpid() % 100000
        self.names = [f"sw1b{tag}-{i}" for i in range(count)]
        self.veths = [f"sw1b{tag}a", f"sw1b{tag}b"]
        self.addrs = ["127.0.0.1"] if count == 1 else ["10.78.0.1", "10.78.0.2"]
        self.rate = rate
        self.qdisc = None

    def __enter__(self):
        try:
            for ns in self.names:
                _sh("ip", "netns", "add", ns)
                _sh("ip", "-n", ns, "link", "set", "lo", "up")
            if len(self.names) == 2:
                a, b = self.veths
                _sh("ip", "link", "add", a, "netns", self.names[0], "type", "veth", "peer", "name", b,
                    "netns", self.names[1])
                for ns, dev, addr in zip(self.names, self.veths, self.addrs):
                    _sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
                    _sh("ip", "-n", ns, "link", "set", dev, "up")
                    if self.rate:
                        self.qdisc = _shape(ns, dev, self.rate)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        for ns in self.names:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)

    def prefix(self, node: int) -> list[str]:
        return ["ip", "netns", "exec", self.names[node]]

    def ifname(self, node: int) -> str:
        return "lo" if len(self.names) == 1 else self.veths[node]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(opt: str, world: int, args, ns: Namespaces | None) -> dict:
    nodes = 1 if ns is None else len(ns.names)
    per_node = world // nodes
    port = 29500 if ns is not None else _free_port()  # a private namespace has every port free
    master = "127.0.0.1" if ns is None else ns.addrs[0]
    with tempfile.TemporaryDirectory() as tmp:
        procs = []
        for rank in range(world):
            node = rank // per_node
            cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--rank", str(rank),
                   "--local-rank", str(rank % per_node), "--world", str(world), "--opt", opt,
                   "--master", master, "--port", str(port), "--steps", str(args.steps), "--warmup",
                   str(args.warmup), "--width", str(args.width), "--out", os.path.join(tmp, f"{rank}.json")]
            env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
            if ns is not None:
                cmd = ns.prefix(node) + cmd
                env["GLOO_SOCKET_IFNAME"] = ns.ifname(node)
            procs.append(subprocess.Popen(cmd, env=env))
        codes = [p.wait(timeout=1200) for p in procs]
        if any(codes):
            raise RuntimeError(f"{opt} at {world} ranks: exit codes {codes}")
        results = [json.load(open(os.path.join(tmp, f"{r}.json"))) for r in range(world)]
    first = results[0]
    # each namespace's counters are read by all of its ranks: take one reading per namespace
    tx = sum(results[node * per_node]["tx_bytes"] for node in range(nodes)) / world
    return {**first, "tx_per_rank": tx}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--steps", type=int, default=45)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--links", nargs="+", default=["loopback", "1gbit"])
    ap.add_argument("--optimizers", nargs="+", default=list(OPTIMIZERS),
                    help="types to compare (the first is the reference); 'type:1' runs it at ZeRO stage 1")
    ap.add_argument("--worker", action="store_true")
    for name in ("rank", "local-rank", "world", "port"):
        ap.add_argument(f"--{name}", type=int, default=0)
    ap.add_argument("--opt", default="Adam")
    ap.add_argument("--master", default="127.0.0.1")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    root = os.geteuid() == 0
    links = args.links if root else ["loopback"]
    import torch

    print(f"wide MLP (width {args.width}), {MICRO} samples per rank, {args.steps} steps, warm-up {args.warmup}, "
          f"measured from step {args.warmup + 5}; torch {torch.__version__}; "
          f"{'private network namespaces' if root else 'host namespace (lo counters include other traffic)'}")
    print("| link | ranks | optimizer | logged bytes/step (rank 0) | wire bytes/step per rank | vs Adam | "
          "step time (ms) | vs Adam | final loss |")
    print("|---|---|---|---|---|---|---|---|---|")
    shaped = None
    for link in links:
        for world in args.worlds:
            rows = {}
            for opt in args.optimizers:
                if not root:
                    rows[opt] = run(opt, world, args, None)
                else:
                    with Namespaces(1 if link == "loopback" else 2, None if link == "loopback" else "1gbit") as ns:
                        rows[opt] = run(opt, world, args, ns)
                        shaped = ns.qdisc or shaped
            adam = rows[args.optimizers[0]]
            for opt, r in rows.items():
                name, _, stage = opt.partition(":")
                label = f"{name} (ZeRO-{stage})" if stage else name
                print(f"| {link} | {world} | {label} | {r['logged_bytes']:,.0f} | {r['tx_per_rank']:,.0f} | "
                      f"{adam['tx_per_rank'] / max(r['tx_per_rank'], 1):.1f}x less | {r['step_ms']:.1f} | "
                      f"{r['step_ms'] / adam['step_ms']:.2f} | {r['loss']:.4f} |", flush=True)
    print(f"parameters: {rows[args.optimizers[0]]['params']:,}" + (f"; link shaping: {shaped}" if root and "1gbit" in links else ""))


if __name__ == "__main__":
    main()
