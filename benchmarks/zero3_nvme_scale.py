"""Scale run: a GPT whose model states exceed the memory the job may use, trained with ZeRO-3 and
parameters + optimizer offloaded to NVMe, on 2 CPU processes inside a memory-capped cgroup.

    sudo python benchmarks/zero3_nvme_scale.py [--layers 24] [--width 1024] [--cap-gb 3] [--steps 3] \
        [--nvme /work/nvme-scratch] [--preset 2b]

``--preset 2b`` is the ~2B-parameter run (40 layers, width 2048: 32 GiB of model states, about
1.5x this 24 GiB machine's RAM) under an 8 GiB cap.

The model is built under ``shardwise.zero.Init`` (never whole on a rank).  The script creates a
memory cgroup (v1 ``memory.limit_in_bytes`` or v2 ``memory.max``), moves itself into it, then
spawns the ranks, so the cap covers the whole job.  It prints the model size, the model-state bytes
(16 bytes per parameter: bf16 weights and gradients, fp32 master weights and Adam states), the
cap, each step's time, tokens/s, every rank's peak RSS, the bytes on disk, the swap traffic per
step (bytes the NVMe store read and wrote, and the kernel's count of storage I/O of the rank from
``/proc/self/io``) and the share of the step the rank spent blocked waiting on swap I/O.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import socket
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples", "gpt"))
sys.path.insert(0, ROOT)


def _cap_memory(limit: int) -> str:
    """Put this process (and its future children) in a memory cgroup limited to ``limit`` bytes."""
    name = f"shardwise-scale-{os.getpid()}"
    v1 = "/sys/fs/cgroup/memory"
    if os.path.isdir(v1):
        path = os.path.join(v1, name)
        os.makedirs(path, exist_ok=True)
        open(os.path.join(path, "memory.limit_in_bytes"), "w").write(str(limit))
    else:
        path = os.path.join("/sys/fs/cgroup", name)
        os.makedirs(path, exist_ok=True)
        open(os.path.join(path, "memory.max"), "w").write(str(limit))
    open(os.path.join(path, "cgroup.procs"), "w").write(str(os.getpid()))
    return path


def _proc_io() -> tuple[int, int]:
    """(read_bytes, write_bytes) this process caused to be fetched from / sent to storage."""
    fields = dict(line.split(": ") for line in open("/proc/self/io").read().splitlines())
    return int(fields["read_bytes"]), int(fields["write_bytes"])


def _worker(rank, world, port, args, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    import shardwise
    from model import GPT, GPTConfig, lm_loss

    cfg = {
        "train_micro_batch_size_per_gpu": 1, "gradient_clipping": 1.0, "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": {
            "stage": 3, "sub_group_size": 10_000_000, "stage3_param_persistence_threshold": 0,
            "stage3_prefetch_bucket_size": 20_000_000, "reduce_bucket_size": 20_000_000,
            "offload_param": {"device": "nvme", "nvme_path": args.nvme},
            "offload_optimizer": {"device": "nvme", "nvme_path": args.nvme, "buffer_count": 2}},
        "aio": {"thread_count": args.aio_threads, "queue_depth": args.queue_depth, "block_size": args.block_size},
    }
    torch.manual_seed(0)
    with shardwise.zero.Init(dtype=torch.bfloat16):  # shards held in bf16 until offloaded
        model = GPT(GPTConfig(vocab_size=128, block_size=64, n_layer=args.layers, n_head=16, n_embd=args.width))
    params = sum(p.ds_numel for p in model.parameters())
    engine, *_ = shardwise.initialize(model=model, config=cfg)
    from shardwise.zero.nvme_io import STATS

    x = torch.randint(0, 128, (1, 64))
    times, traffic = [], []
    for _ in range(args.steps):
        io0, st0 = _proc_io(), STATS.snapshot()
        t0 = time.perf_counter()
        loss = lm_loss(engine(x), x)
        engine.backward(loss)
        engine.step()
        times.append(time.perf_counter() - t0)
        io1, st1 = _proc_io(), STATS.snapshot()
        traffic.append((st1[0] - st0[0], st1[1] - st0[1], st1[2] - st0[2], io1[0] - io0[0], io1[1] - io0[1]))
    m = engine.memory_breakdown()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    with open(os.path.join(out_dir, f"rank{rank}"), "w") as f:
        f.write(f"{params} {peak} {m.on_disk} {loss.item()} " + " ".join(map(str, times)) + "\n")
        for row in traffic:
            f.write(" ".join(map(str, row)) + "\n")
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--cap-gb", type=float, default=3.0)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--nvme", default=None)
    ap.add_argument("--preset", choices=["2b"], default=None, help="2b: 40 layers x 2048, 8 GiB cap")
    ap.add_argument("--aio-threads", type=int, default=2)
    ap.add_argument("--queue-depth", type=int, default=8)
    ap.add_argument("--block-size", type=int, default=1 << 20)
    args = ap.parse_args()
    if args.preset == "2b":
        args.layers, args.width, args.cap_gb = 40, 2048, 8.0
    args.nvme = args.nvme or tempfile.mkdtemp(prefix="shardwise-scale-nvme-", dir=ROOT)
    cap = int(args.cap_gb * 2**30)
    cgroup = _cap_memory(cap)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(_worker, args=(2, port, args, out), nprocs=2, start_method="spawn")
        texts = [open(os.path.join(out, f"rank{r}")).read().splitlines() for r in range(2)]
    rows = [t[0].split() for t in texts]
    traffic = [[[float(v) for v in line.split()] for line in t[1:]] for t in texts]
    params = int(rows[0][0])
    states = 16 * params
    print(f"GPT {args.layers} layers x width {args.width}: {params / 1e6:.0f}M parameters; model states "
          f"{states / 2**30:.2f} GiB (16 B/parameter); job memory cap {cap / 2**30:.2f} GiB (cgroup {cgroup})")
    print("| rank | peak RSS (GiB) | on disk (GiB) | step times (s) | final loss |")
    print("|---|---|---|---|---|")
    for r, row in enumerate(rows):
        steps = ", ".join(f"{float(t):.1f}" for t in row[4:])
        print(f"| {r} | {int(row[1]) / 2**30:.2f} | {int(row[2]) / 2**30:.2f} | {steps} | {float(row[3]):.3f} |")
    tokens = 2 * 64  # 2 ranks x micro-batch 1 x 64 tokens
    print("\n| step | s | tokens/s | swap read / written per rank (GiB) | storage I/O read / written per rank "
          "(GiB, /proc/self/io) | blocked on swap I/O |")
    print("|---|---|---|---|---|---|")
    for k in range(len(rows[0]) - 4):
        t = max(float(row[4 + k]) for row in rows)
        rd = "/".join(f"{tr[k][0] / 2**30:.2f}" for tr in traffic)
        wr = "/".join(f"{tr[k][1] / 2**30:.2f}" for tr in traffic)
        prd = "/".join(f"{tr[k][3] / 2**30:.2f}" for tr in traffic)
        pwr = "/".join(f"{tr[k][4] / 2**30:.2f}" for tr in traffic)
        wait = "/".join(f"{100 * tr[k][2] / float(row[4 + k]):.0f}%" for tr, row in zip(traffic, rows))
        print(f"| {k + 1} | {t:.1f} | {tokens / t:.1f} | {rd} / {wr} | {prd} / {pwr} | {wait} |")
    shutil.rmtree(args.nvme, ignore_errors=True)
    root = os.path.dirname(cgroup)
    open(os.path.join(root, "cgroup.procs"), "w").write(str(os.getpid()))  # leave, then remove the cgroup
    try:
        os.rmdir(cgroup)
    except OSError:  # a helper process (e.g. multiprocessing's resource tracker) may still be in it
        print(f"(cgroup {cgroup} left behind: remove it with rmdir once its processes are gone)")


if __name__ == "__main__":
    main()
