"""ZeRO-3 vs ZeRO++ (qwZ + hpZ + qgZ) on the reference GPT, two "nodes" of two ranks each, over a slow link
and over loopback.

    sudo python benchmarks/zeropp.py [--steps 50] [--repeats 2] [--rate 1gbit] [--plot zeropp_convergence.png]
    python benchmarks/zeropp.py --accuracy 'qwz;qgz;loco;qwz,hpz,qgz' --steps 200     # losses only, loopback

Two network namespaces (tests/netns_cluster.py's ``NetnsCluster``, the hosts of the multi-node launcher
tests) are joined by a veth pair; both ends are shaped with ``tc`` (a token bucket, ``--rate``, 1 Gbit/s by
default: a slow inter-node network). Each namespace runs two CPU ranks over gloo, so the traffic between two
ranks of one "node" stays on its loopback and only the traffic between the nodes crosses the shaped link. The
same four ranks also run in this namespace over plain loopback (``LOCAL_WORLD_SIZE=2``: the same two
"nodes", nothing shaped). Every rank runs the public API (``initialize``, ``forward``/``backward``/``step``)
on the same model, data and seed; the ZeRO++ run adds ``zero_quantized_weights``, ``zero_hpz_partition_size:
2`` and ``zero_quantized_gradients`` (``--parts`` picks a subset; ``--parts none`` runs ZeRO-3 on both sides,
a check of the harness).

ZeRO-3 cuts the model into units of at most ``--unit-elements`` elements (``stage3_prefetch_bucket_size``);
the default, 2,000,000, gives a unit per transformer block, each gathered for forward and again for
backward, as in a model larger than the bucket (the regime ZeRO++ is built for: hpZ moves the backward
gathers inside the node). With DeepSpeed's default bucket (50,000,000) the whole reference GPT is one unit,
and no gather overlaps compute.

Measured per configuration and network, over ``--repeats`` runs that alternate ZeRO-3 and ZeRO++: the
median step time of the slowest rank (after ``--warmup`` steps; the median over the runs, and each
ZeRO-3 / ZeRO++ pair's ratio), the bytes per step the comms logger counts (every collective's whole message, summed over the four
ranks), the part of them that crosses between the two nodes (the logger's ``cross_node_bytes``: what each
rank receives from the other node, summed), and on the shaped network the bytes per step that really crossed the link (the veth counters of both
namespaces, TCP/IP headers included). The table gives each figure for ZeRO-3, for ZeRO++ and their ratio;
the plot (matplotlib, ``pip install 'shardwise[plot]'``) draws the loss of every step of both runs.

Needs root, iproute2 (``ip``, ``tc``) and ``unshare`` for the shaped network; ``--networks loopback`` runs
without them.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NODES, PER_NODE = 2, 2
WORLD = NODES * PER_NODE
PARTS = {"qwz": {"zero_quantized_weights": True}, "hpz": {"zero_hpz_partition_size": PER_NODE},
         "qgz": {"zero_quantized_gradients": True},
         "loco": {"zero_quantized_gradients": True, "zeropp_loco_param": {"err_beta": 0.8, "reset_T": 1024}},
         # qgZ in DeepSpeed's exact layout (int4 on both hops, a group per matrix row): for comparison only
         "qgz-ds": {"zero_quantized_gradients": True}}
DEEPSPEED_LAYOUT = {"qgz-ds"}


# ------------------------------------------------------------------------------------------ worker
def _batch(step: int, args):
    """Learnable synthetic text: each row counts up from a random start by a random stride (mod vocab)."""
    import torch

    g = torch.Generator().manual_seed(1000 + 100_000 * args.seed + step)
    start = torch.randint(0, args.vocab, (args.rows, 1), generator=g)
    stride = torch.randint(1, 8, (args.rows, 1), generator=g)
    tokens = (start + stride * torch.arange(args.seq + 1)) % args.vocab
    return tokens[:, :-1], tokens[:, 1:]


def _link_bytes(ifname: str | None) -> int:
    if not ifname:
        return 0
    total = 0
    for way in ("tx_bytes", "rx_bytes"):
        with open(f"/sys/class/net/{ifname}/statistics/{way}") as f:
            total += int(f.read())
    return total


def worker(args) -> None:
    import torch

    import shardwise
    from shardwise import comm
    from shardwise.models.gpt import GPT, GPTConfig

    torch.set_num_threads(1)
    if DEEPSPEED_LAYOUT & set(args.parts):  # qgZ as DeepSpeed codes it: int4 inside the node too, groups uncut
        from shardwise.zero import qgz

        qgz.INTRA_BITS, qgz.GROUP_CAP = 4, 0
    shardwise.init_distributed()
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": args.unit_elements}
    for part in args.parts:
        zero.update(PARTS[part])
    per = args.rows // world
    config = {"train_batch_size": args.rows, "train_micro_batch_size_per_gpu": per, "steps_per_print": 10**9,
              "optimizer": {"type": "AdamW", "params": {"lr": args.lr}}, "zero_optimization": zero,
              "comms_logger": {"enabled": True}}
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=args.vocab, seq_len=args.seq, hidden=args.hidden, n_layers=args.layers,
                    n_heads=args.heads)
    engine = shardwise.initialize(model=GPT(cfg), config=config)[0]
    times, losses = [], []
    sent = [0, 0]
    for step in range(args.warmup + args.steps):
        x, y = _batch(step, args)
        x, y = x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]
        if step == args.warmup:
            comm.reset_comms_log()
            sent[0] = _link_bytes(args.ifname)
        torch.distributed.barrier()
        t0 = time.perf_counter()
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        torch.distributed.barrier()
        if step >= args.warmup:
            times.append(time.perf_counter() - t0)
        mean = loss.detach().clone()
        torch.distributed.all_reduce(mean)
        losses.append(float(mean) / world)
    sent[1] = _link_bytes(args.ifname)
    logged = sum(size * s["count"] for sizes in comm.comms_summary().values() for size, s in sizes.items())
    from shardwise.comm import ops

    cross = ops.logger.cross_node_bytes(PER_NODE)
    row = {"step_s": statistics.median(times), "logged_bytes": logged / args.steps,
           "cross_node_bytes": cross / args.steps,
           "link_bytes": (sent[1] - sent[0]) / args.steps if args.ifname and rank % PER_NODE == 0 else 0,
           "losses": losses, "file": shardwise.__file__}
    rows = [None] * world
    torch.distributed.all_gather_object(rows, row)
    if rank == 0:
        print("RESULT " + json.dumps(rows), flush=True)


# ------------------------------------------------------------------------------------------ driver
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker_cmd(args, parts: list[str], ifname: str | None) -> list[str]:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--parts", ",".join(parts) or "none",
           "--steps", str(args.steps), "--warmup", str(args.warmup), "--layers", str(args.layers),
           "--hidden", str(args.hidden), "--heads", str(args.heads), "--seq", str(args.seq),
           "--rows", str(args.rows), "--vocab", str(args.vocab), "--lr", str(args.lr),
           "--unit-elements", str(args.unit_elements), "--seed", str(args.seed)]
    return cmd + (["--ifname", ifname] if ifname else [])


def _env(rank: int, master: str, port: int, ifname: str) -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "RANK": str(rank), "WORLD_SIZE": str(WORLD),
            "LOCAL_RANK": str(rank % PER_NODE), "LOCAL_WORLD_SIZE": str(PER_NODE), "NODE_RANK": str(rank // PER_NODE),
            "MASTER_ADDR": master, "MASTER_PORT": str(port), "GLOO_SOCKET_IFNAME": ifname,
            "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}


def _collect(procs: list[subprocess.Popen], what: str, timeout: float) -> list[dict]:
    outs = []
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            outs.append(p.communicate(timeout=max(deadline - time.monotonic(), 1)))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            sys.exit(f"{what}: timed out after {timeout:.0f} s")
    line = next((ln for ln in outs[0][0].splitlines() if ln.startswith("RESULT ")), None)
    if line is None or any(p.returncode for p in procs):
        tail = "\n".join(f"rank {r}: rc {p.returncode}\n{o[1][-2000:]}" for r, (p, o) in enumerate(zip(procs, outs)))
        sys.exit(f"{what} failed:\n{tail}")
    rows = json.loads(line[len("RESULT "):])
    if not rows[0]["file"].startswith(os.path.join(ROOT, "shardwise")):
        sys.exit(f"the workers imported {rows[0]['file']}, not this checkout's shardwise")
    return rows


def run_loopback(args, parts: list[str]) -> list[dict]:
    port = _free_port()
    procs = [subprocess.Popen(_worker_cmd(args, parts, None), env=_env(r, "127.0.0.1", port, "lo"),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
             for r in range(WORLD)]
    return _collect(procs, f"loopback {'+'.join(parts) or 'ZeRO-3'}", args.timeout)


class ShapedLink:
    """Two namespaces joined by a veth pair shaped with ``tc`` to ``rate``; no sshd (the ranks start directly)."""

    def __init__(self, rate: str) -> None:
        sys.path.insert(0, os.path.join(ROOT, "tests"))
        from netns_cluster import NetnsCluster

        self.cluster = NetnsCluster(NODES)
        self.rate = rate

    def __enter__(self) -> "ShapedLink":
        c = self.cluster
        try:
            c._network()
            for name, dev in zip(c.names, c.veths):
                # a token bucket at the link rate: what a slow network between two nodes lets through
                subprocess.run(["ip", "netns", "exec", name, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
                                "rate", self.rate, "burst", "256kb", "latency", "100ms"], check=True,
                               capture_output=True, text=True, timeout=30)
        except BaseException:
            c.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.cluster.close()

    def run(self, args, parts: list[str]) -> list[dict]:
        c, port = self.cluster, _free_port()
        procs = []
        for r in range(WORLD):
            node = r // PER_NODE
            procs.append(subprocess.Popen(c.command(node, _worker_cmd(args, parts, c.veths[node])),
                                          env=_env(r, c.hosts[0], port, c.veths[node]), stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True, cwd=ROOT, start_new_session=True))
        return _collect(procs, f"shaped link {'+'.join(parts) or 'ZeRO-3'}", args.timeout)


def _missing_for_netns() -> str | None:
    import shutil

    if os.geteuid() != 0:
        return "the shaped network needs root (network namespaces, tc)"
    for tool in ("ip", "tc", "unshare"):
        if shutil.which(tool) is None:
            return f"the shaped network needs {tool} (iproute2, util-linux)"
    return None


def _summary(rows: list[dict]) -> dict:
    return {"step_s": max(r["step_s"] for r in rows), "logged_bytes": sum(r["logged_bytes"] for r in rows),
            "cross_node_bytes": sum(r["cross_node_bytes"] for r in rows),
            "link_bytes": sum(r["link_bytes"] for r in rows) / 2,  # both ends count each byte once (tx + rx)
            "losses": rows[0]["losses"]}


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f} MiB"


def plot(results: dict, path: str, args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    network = "shaped" if any(k[0] == "shaped" for k in results) else "loopback"
    for (net, name), res in sorted(results.items()):
        if net == network:
            ax.plot(range(1, len(res["losses"]) + 1), res["losses"], label=name)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (mean over ranks)")
    ax.set_title(f"reference GPT, {WORLD} ranks ({NODES} nodes x {PER_NODE})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"convergence plot: {path}")


def accuracy(args) -> None:
    """ZeRO-3 and each set of parts over loopback, the same model, data and seed: how far the losses move."""
    sets = [[x.strip().lower() for x in group.split(",") if x.strip()] for group in args.accuracy.split(";")]
    bad = sorted({x for group in sets for x in group if x not in PARTS})
    if bad or not all(sets):
        sys.exit(f"--accuracy: unknown parts {bad} (choose from {sorted(PARTS)}), or an empty set")
    args.warmup = 0
    base = run_loopback(args, [])[0]["losses"]
    marks = [m for m in (20, 60, 100) if m < len(base)] + [len(base)]
    print(f"reference GPT hidden {args.hidden}, {args.layers} layers, {args.heads} heads, seq {args.seq}, vocab "
          f"{args.vocab}, {args.rows} rows per step (batches of seed {args.seed}), AdamW lr {args.lr}; {NODES} nodes x "
          f"{PER_NODE} CPU ranks over "
          f"loopback. ZeRO-3's loss (mean over ranks) goes from {base[0]:.4f} to {base[-1]:.4f}")
    print("largest relative gap of a step's loss to ZeRO-3's, over the first N steps")
    print(f"{'parts':<24}" + "".join(f"{'N=' + str(m):>10}" for m in marks))
    out = {"ZeRO-3": base}
    for group in sets:
        losses = run_loopback(args, group)[0]["losses"]
        out["+".join(group)] = losses
        gaps = [abs(a - b) / abs(a) for a, b in zip(base, losses)]
        print(f"{'+'.join(group):<24}" + "".join(f"{100 * max(gaps[:m]):>9.2f}%" for m in marks), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f)
    if args.plot:
        plot_curves(out, args.plot, f"reference GPT (hidden {args.hidden}), {WORLD} ranks ({NODES} nodes x "
                    f"{PER_NODE}), loopback")


def plot_curves(curves: dict, path: str, title: str) -> None:
    """Every run's loss per step (``curves``: name -> losses), and below it each run's relative gap to the first
    run's (ZeRO-3's)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True, height_ratios=[2, 1])
    names = list(curves)
    base = curves[names[0]]
    for i, name in enumerate(names):
        steps = range(1, len(curves[name]) + 1)
        top.plot(steps, curves[name], label=name, linewidth=1, color=f"C{i}")
        if i:
            bottom.plot(steps, [100 * (b - a) / a for a, b in zip(base, curves[name])], linewidth=1, color=f"C{i}")
    top.set_ylabel("training loss (mean over ranks)")
    top.set_title(title)
    top.legend(fontsize=8)
    bottom.axhline(1, color="grey", linestyle=":", linewidth=0.8)
    bottom.axhline(-1, color="grey", linestyle=":", linewidth=0.8)
    bottom.set_ylabel(f"gap to {names[0]} (%)")
    bottom.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"convergence plot: {path}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--ifname", default=None, help=argparse.SUPPRESS)
    p.add_argument("--parts", default="qwz,hpz,qgz",
                   help="the ZeRO++ parts of the second run, comma-separated, or none (default: all three)")
    p.add_argument("--networks", default="shaped,loopback", help="shaped, loopback or both (default)")
    p.add_argument("--rate", default="1gbit", help="tc rate of the link between the two nodes (default 1gbit)")
    p.add_argument("--steps", type=int, default=50, help="timed steps, after --warmup (default 50)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=2,
                   help="runs of each configuration per network, alternating ZeRO-3 and ZeRO++ (default 2)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=384)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--rows", type=int, default=8, help="global batch rows (default 8: 2 per rank)")
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0, help="which synthetic batches (default 0)")
    p.add_argument("--unit-elements", type=int, default=2_000_000,
                   help="stage3_prefetch_bucket_size, the most elements of a ZeRO-3 unit (default 2,000,000: a unit "
                        "per transformer block, each gathered for forward and again for backward, as in a model "
                        "larger than the bucket; 50,000,000, DeepSpeed's default, makes the whole reference GPT one "
                        "unit)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per run (default 1800)")
    p.add_argument("--plot", default="zeropp_convergence.png",
                   help="where to write the loss plot ('' for none); with --accuracy, every set's losses and gaps")
    p.add_argument("--json", default=None, help="also write every figure and loss to this file")
    p.add_argument("--accuracy", default=None, metavar="SETS",
                   help="instead of timing: train ZeRO-3 and each set of parts (';'-separated, e.g. "
                        "'qwz;qgz;loco;qwz,hpz,qgz') over loopback for --steps steps and print each set's largest "
                        "relative gap of a step's loss to ZeRO-3's; the part qgz-ds is qgZ in DeepSpeed's layout "
                        "(int4 on both hops, a group per matrix row)")
    args = p.parse_args()
    if args.accuracy and not args.worker:
        accuracy(args)
        return
    parts = [] if args.parts.strip().lower() in ("", "none") else [s.strip().lower() for s in args.parts.split(",")]
    bad = [s for s in parts if s not in PARTS]
    if bad:
        p.error(f"--parts: unknown {bad}; choose from {sorted(PARTS)} or none")
    args.parts = parts
    if args.worker:
        worker(args)
        return
    networks = [s.strip() for s in args.networks.split(",") if s.strip()]
    if not networks or any(n not in ("shaped", "loopback") for n in networks):
        p.error(f"--networks: expected shaped, loopback or both, got {args.networks!r}")
    if "shaped" in networks and (why := _missing_for_netns()):
        sys.exit(f"{why}; run as root, or --networks loopback")
    if args.rows % WORLD:
        p.error(f"--rows must be a multiple of {WORLD}")
    zeropp = "ZeRO++ (" + "+".join(parts) + ")" if parts else "ZeRO-3 again (--parts none)"
    runs = [("ZeRO-3", []), (zeropp, parts)]
    results: dict = {}
    pairs: dict = {}  # network -> each repeat's step-time ratio
    for net in networks:
        for rep in range(args.repeats):  # A B A B: ZeRO-3 and ZeRO++ alternate
            times = {}
            for name, which in runs:
                if net == "shaped":
                    with ShapedLink(args.rate) as link:
                        rows = link.run(args, which)
                else:
                    rows = run_loopback(args, which)
                res = _summary(rows)
                times[name] = res["step_s"]
                prev = results.get((net, name))
                res["step_times"] = (prev["step_times"] if prev else []) + [res["step_s"]]
                res["step_s"] = statistics.median(res["step_times"])
                results[(net, name)] = res
            pairs.setdefault(net, []).append(times[runs[0][0]] / times[runs[1][0]])
    print(f"reference GPT hidden {args.hidden}, {args.layers} layers, {args.heads} heads, seq {args.seq}, vocab "
          f"{args.vocab}, {args.rows} rows per step, ZeRO-3 units of at most {args.unit_elements:,} elements; "
          f"{NODES} nodes x {PER_NODE} CPU ranks over gloo; step time: the slowest rank's median of {args.steps} "
          f"steps, the median of {args.repeats} runs alternating ZeRO-3 and ZeRO++")
    header = f"{'network':<22} {'figure':<26} {'ZeRO-3':>12} {zeropp.split(' (')[0]:>12} {'ratio':>8}"
    print(header)
    print("-" * len(header))
    base_name, pp_name = runs[0][0], runs[1][0]
    for net in networks:
        label = f"shaped ({args.rate})" if net == "shaped" else "loopback"
        a, b = results[(net, base_name)], results[(net, pp_name)]
        figures = [("step time", a["step_s"], b["step_s"], lambda v: f"{v * 1000:.1f} ms"),
                   ("logged bytes/step", a["logged_bytes"], b["logged_bytes"], _mib),
                   ("cross-node bytes/step", a["cross_node_bytes"], b["cross_node_bytes"], _mib)]
        if net == "shaped":
            figures.append(("link bytes/step", a["link_bytes"], b["link_bytes"], _mib))
        for what, va, vb, fmt in figures:
            ratio = f"{va / vb:.2f}x" if what == "step time" and vb else f"{vb / va:.3f}" if va else "-"
            print(f"{label:<22} {what:<26} {fmt(va):>12} {fmt(vb):>12} {ratio:>8}")
        print(f"{label:<22} {'speed-up of each pair':<26} " + ", ".join(f"{x:.2f}x" for x in pairs[net]))
    print("ratio: ZeRO-3 / ZeRO++ for step time (the speed-up), ZeRO++ / ZeRO-3 for bytes (the share left)")
    for net in networks:
        a, b = results[(net, base_name)]["losses"], results[(net, pp_name)]["losses"]
        print(f"{net}: final loss ZeRO-3 {a[-1]:.4f}, {pp_name} {b[-1]:.4f} "
              f"(largest relative gap over the run {max(abs(x - y) / abs(x) for x, y in zip(a, b)):.4f})")
    if args.plot:
        plot(results, args.plot, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**{f"{net}/{name}": res for (net, name), res in results.items()},
                       "pair_speedups": pairs}, f, indent=1)


if __name__ == "__main__":
    main()
