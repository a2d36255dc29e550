"""Checkpoint save/load cost at ZeRO stages 0-3 vs ``torch.save`` of a full state dict, and
training step time with an asynchronous save in flight.

    python benchmarks/checkpoint_io.py [--procs 2] [--repeats 5] [--width 128 --layers 4]
                                       [--async-width 256 --async-layers 8]

Part 1 (demo GPT by default): for each stage, a fresh group of processes trains 2 steps, then
saves and loads ``--repeats`` times; save time is rank 0's wall time from a barrier before the
call to the barrier after it (fsync included), load time the same for ``load_checkpoint`` into
the training engine.  Bytes per rank are the manifest's file sizes by writer.  The baseline is
rank 0 alone saving ``{"model": state_dict, "optimizer": AdamW.state_dict()}`` of the same model
with ``torch.save`` (+ fsync, as ours does) and loading it back (``torch.load`` +
``load_state_dict``); it is what one data-parallel rank would write without ZeRO.

Part 2 (a bigger GPT, stage 2, ``checkpoint.writer.decoupled``): median step time without
saves, the time ``save_checkpoint`` blocks (sync vs async), and the median time of the steps
taken while an asynchronous save is being written.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples", "gpt"))
sys.path.insert(0, ROOT)
MICRO = 8


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _engine(stage: int, width: int, layers: int, extra: dict | None = None):
    import shardwise
    from model import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(n_embd=width, n_layer=layers, n_head=4))
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_clipping": 1.0,
           "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01}},
           "zero_optimization": {"stage": stage, "reduce_bucket_size": 5_000_000,
                                 "stage3_param_persistence_threshold": 0}, **(extra or {})}
    engine, *_ = shardwise.initialize(model=model, config=cfg)
    return engine


def _step(engine, rank: int, i: int) -> float:
    from model import lm_loss

    g = torch.Generator().manual_seed(1000 * i + rank)
    x = torch.randint(0, 128, (MICRO, 64), generator=g)
    t0 = time.perf_counter()
    engine.backward(lm_loss(engine(x), torch.roll(x, -1, 1)))
    engine.step()
    return time.perf_counter() - t0


def _timed(fn) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t0


def _bytes_per_rank(folder: str, world: int) -> list[int]:
    manifest = json.load(open(os.path.join(folder, "manifest.json")))
    out = [0] * world
    out[0] += os.path.getsize(os.path.join(folder, "manifest.json"))
    for name, size in manifest["sizes"].items():
        stem = name.split(".")[0]
        rank = int(stem.split("rank")[1].split("_")[0]) if "rank" in stem else 0
        out[rank] += size
    return out


def _torch_baseline(width: int, layers: int, repeats: int, where: str) -> dict:
    from model import GPT, GPTConfig, lm_loss

    torch.manual_seed(0)
    model = GPT(GPTConfig(n_embd=width, n_layer=layers, n_head=4))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    x = torch.randint(0, 128, (MICRO, 64))
    lm_loss(model(x), x).backward()
    opt.step()
    path = os.path.join(where, "full.pt")
    saves, loads = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)
        with open(path, "rb") as f:
            os.fsync(f.fileno())
        saves.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        state = torch.load(path, weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        loads.append(time.perf_counter() - t0)
    return {"save_s": statistics.median(saves), "load_s": statistics.median(loads), "bytes": os.path.getsize(path)}


def _io_worker(rank, world, port, stage, args, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo")
    engine = _engine(stage, args.width, args.layers)
    for i in range(2):
        _step(engine, rank, i)
    where = os.path.join(out_dir, f"stage{stage}")
    saves = [_timed(lambda i=i: engine.save_checkpoint(where, tag=f"r{i}")) for i in range(args.repeats)]
    loads = [_timed(lambda i=i: engine.load_checkpoint(where, tag=f"r{i}")) for i in range(args.repeats)]
    if rank == 0:
        result = {"save_s": statistics.median(saves), "load_s": statistics.median(loads),
                  "bytes": _bytes_per_rank(os.path.join(where, "r0"), world),
                  "params": sum(p.numel() for p in engine.module.parameters())}
        if stage == 0:
            result["torch"] = _torch_baseline(args.width, args.layers, args.repeats, out_dir)
        json.dump(result, open(os.path.join(out_dir, f"io{stage}.json"), "w"))
    dist.barrier()
    dist.destroy_process_group()


def _async_worker(rank, world, port, args, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo")
    engine = _engine(2, args.async_width, args.async_layers, {"checkpoint": {"writer": {"decoupled": True}}})
    i = 0
    for _ in range(3):
        i += 1
        _step(engine, rank, i)
    plain = []
    for _ in range(12):
        i += 1
        plain.append(_step(engine, rank, i))
    where = os.path.join(out_dir, "async")
    writer = engine.checkpoint_writer
    blocking, in_flight, overlapped, write_s = [], [], [], []
    for r in range(args.repeats):
        t0 = time.perf_counter()
        engine.save_checkpoint(where, tag=f"a{r}")
        blocking.append(time.perf_counter() - t0)
        n = 0
        while True:  # the ranks agree on each step (their writers finish at different times; steps are collective)
            busy = torch.tensor([float(writer.busy)])
            dist.all_reduce(busy, op=dist.ReduceOp.MAX)
            if not busy.item():
                break
            i += 1
            in_flight.append(_step(engine, rank, i))
            n += 1
        write_s.append(time.perf_counter() - t0)
        overlapped.append(n)
        engine.wait_for_checkpoint()
    engine.config.checkpoint.writer.decoupled = False  # the same save, synchronous
    sync = [_timed(lambda r=r: engine.save_checkpoint(where, tag=f"s{r}")) for r in range(args.repeats)]
    if rank == 0:
        json.dump({"plain_step_s": statistics.median(plain),
                   "in_flight_step_s": statistics.median(in_flight) if in_flight else None,
                   "steps_overlapped": overlapped, "async_blocking_s": statistics.median(blocking),
                   "async_write_s": statistics.median(write_s), "sync_save_s": statistics.median(sync),
                   "params": sum(p.numel() for p in engine.module.parameters()),
                   "bytes": sum(_bytes_per_rank(os.path.join(where, "a0"), world))},
                  open(os.path.join(out_dir, "async.json"), "w"))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--procs", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--async-width", type=int, default=256)
    p.add_argument("--async-layers", type=int, default=8)
    args = p.parse_args()
    out = tempfile.mkdtemp(prefix="shardwise-ckpt-bench-")
    try:
        rows = {}
        for stage in (0, 1, 2, 3):
            mp.spawn(_io_worker, args=(args.procs, _free_port(), stage, args, out), nprocs=args.procs)
            rows[stage] = json.load(open(os.path.join(out, f"io{stage}.json")))
        base = rows[0]["torch"]
        print(f"demo GPT: {rows[0]['params'] / 1e6:.2f}M parameters, fp32, AdamW, {args.procs} processes, "
              f"median of {args.repeats}")
        print("| | save (ms) | load (ms) | bytes per rank |")
        print("|---|---|---|---|")
        print(f"| torch.save full state dict (one rank) | {base['save_s'] * 1e3:.1f} | {base['load_s'] * 1e3:.1f} "
              f"| {base['bytes']:,} |")
        for stage, r in rows.items():
            print(f"| shardwise stage {stage} | {r['save_s'] * 1e3:.1f} | {r['load_s'] * 1e3:.1f} | "
                  f"{' / '.join(f'{b:,}' for b in r['bytes'])} |")
        mp.spawn(_async_worker, args=(args.procs, _free_port(), args, out), nprocs=args.procs)
        a = json.load(open(os.path.join(out, "async.json")))
        print(f"\nasync (GPT {a['params'] / 1e6:.2f}M, stage 2, {a['bytes'] / 1e6:.1f} MB per checkpoint):")
        print("| | ms |")
        print("|---|---|")
        print(f"| step, no save in flight | {a['plain_step_s'] * 1e3:.1f} |")
        in_flight = a["in_flight_step_s"]
        print(f"| step, async save in flight | {in_flight * 1e3:.1f} |" if in_flight else "| step, in flight | n/a |")
        print(f"| save_checkpoint blocks, synchronous | {a['sync_save_s'] * 1e3:.1f} |")
        print(f"| save_checkpoint blocks, asynchronous | {a['async_blocking_s'] * 1e3:.1f} |")
        print(f"| background write until committed | {a['async_write_s'] * 1e3:.1f} "
              f"(steps overlapped: {a['steps_overlapped']}) |")
    finally:
        shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()
