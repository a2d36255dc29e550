"""Raw sequential disk bandwidth (fio, or O_DIRECT dd) against the NVMe swapper's.

    python benchmarks/nvme_bandwidth.py [--dir /work/nvme-scratch] [--gib 2] [--block-size 1048576] \
        [--queue-depth 8] [--threads 1] [--rounds 2]

Measured in one run, taking turns, on the same folder:

- raw: ``fio`` sequential write then read of ``--gib`` GiB with ``direct=1``, ``bs`` = the
  ``aio.block_size`` and ``iodepth`` = ``aio.queue_depth`` (libaio); without fio, ``dd`` with
  ``oflag=direct`` / ``iflag=direct``;
- ``shardwise.zero.nvme_io.NvmeStore`` (the swapper's store): the same bytes as sub-group-like
  requests (fp32 weights + two optimizer states per file, 64 MiB each) written then read back,
  with aligned buffers (``store.empty``, zero-copy) and with ordinary ``torch.empty`` buffers
  (through the bounce buffers);
- a buffered store (``pwritev`` on ``aio.thread_count`` threads), when a tree provides one as
  ``shardwise.zero.offload.NvmeStore`` that is not ``nvme_io.NvmeStore`` (not in this tree).

Write times include an ``fsync`` (otherwise a buffered writer is timed at page-cache speed);
before each read the files' pages are dropped from the page cache (``posix_fadvise``), so reads
come from the disk.  Reported: GB/s and the fraction of fio's.  The files are deleted at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from shardwise.zero import nvme_io  # noqa: E402


def _fio(path: str, rw: str, size: int, bs: int, qd: int) -> float | None:
    if not shutil.which("fio"):
        return None
    out = subprocess.run(["fio", "--name=raw", f"--filename={path}", f"--rw={rw}", f"--bs={bs}", f"--size={size}",
                          "--direct=1", "--ioengine=libaio", f"--iodepth={qd}", "--numjobs=1",
                          "--output-format=json"], capture_output=True, text=True, check=True).stdout
    job = json.loads(out[out.index("{"):])["jobs"][0]
    side = job["write" if rw == "write" else "read"]
    return side["io_bytes"] / (side["runtime"] / 1000.0) / 1e9


def _dd(path: str, rw: str, size: int, bs: int) -> float:
    count = size // bs
    if rw == "write":
        cmd = ["dd", "if=/dev/zero", f"of={path}", f"bs={bs}", f"count={count}", "oflag=direct", "conv=fsync"]
    else:
        cmd = ["dd", f"if={path}", "of=/dev/null", f"bs={bs}", f"count={count}", "iflag=direct"]
    t0 = time.perf_counter()
    subprocess.run(cmd, capture_output=True, check=True)
    return size / (time.perf_counter() - t0) / 1e9


def _drop_cache(folder) -> None:
    for name in os.listdir(folder):
        fd = os.open(os.path.join(folder, name), os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _store_run(store, size: int, aligned: bool) -> tuple[float, float]:
    """Write then read ``size`` bytes as files of (weights, exp_avg, exp_avg_sq) requests."""
    part = 64 << 20  # bytes per request
    numel = part // 4
    make = store.empty if aligned and hasattr(store, "empty") else (lambda n, d: torch.empty(n, dtype=d))
    bufs = [make(numel, torch.float32) for _ in range(3)]
    for b in bufs:
        b.uniform_()
    files = size // (3 * part)
    t0 = time.perf_counter()
    futures = [store.write_async(f"sg{i}.bin", bufs[k], k * part) for i in range(files) for k in range(3)]
    for f in futures:
        f.result()
    _drop_cache(store.dir)  # includes the fsync
    t_write = time.perf_counter() - t0
    moved = files * 3 * part
    t0 = time.perf_counter()
    futures = [store.read_async(f"sg{i}.bin", bufs[k], k * part) for i in range(files) for k in range(3)]
    for f in futures:
        f.result()
    t_read = time.perf_counter() - t0
    for name in os.listdir(store.dir):
        os.unlink(os.path.join(store.dir, name))
    return moved / t_write / 1e9, moved / t_read / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--gib", type=float, default=2.0)
    ap.add_argument("--block-size", type=int, default=1 << 20)
    ap.add_argument("--queue-depth", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    folder = args.dir or tempfile.mkdtemp(prefix="shardwise-nvme-bw-", dir=ROOT)
    os.makedirs(folder, exist_ok=True)
    size = int(args.gib * 2**30)
    size -= size % (3 * (64 << 20))

    try:
        from shardwise.zero.offload import NvmeStore as OldStore
        if OldStore is nvme_io.NvmeStore:
            OldStore = None
    except ImportError:
        OldStore = None

    results: dict[str, list[tuple[float, float]]] = {}
    raw_name = "fio (direct, libaio)" if shutil.which("fio") else "dd (O_DIRECT)"
    for r in range(args.rounds):
        path = os.path.join(folder, "raw.bin")
        if shutil.which("fio"):
            w = _fio(path, "write", size, args.block_size, args.queue_depth)
            rd = _fio(path, "read", size, args.block_size, args.queue_depth)
        else:
            w, rd = _dd(path, "write", size, args.block_size), _dd(path, "read", size, args.block_size)
        os.unlink(path)
        results.setdefault(raw_name, []).append((w, rd))
        new = nvme_io.NvmeStore(folder, rank=0, threads=args.threads, block_size=args.block_size,
                                queue_depth=args.queue_depth)
        results.setdefault(f"NvmeStore (O_DIRECT={new.direct}, aligned buffers)", []).append(
            _store_run(new, size, aligned=True))
        results.setdefault(f"NvmeStore (O_DIRECT={new.direct}, torch.empty buffers)", []).append(
            _store_run(new, size, aligned=False))
        new.close()
        if OldStore is not None:
            old = OldStore(folder, rank=0, threads=args.threads, block_size=args.block_size)
            results.setdefault("previous store (buffered, thread_count threads)", []).append(
                _store_run(old, size, aligned=False))
            old.close()
        print(f"round {r + 1}/{args.rounds} done", flush=True)
    shutil.rmtree(folder, ignore_errors=True) if args.dir is None else None

    raw_w = max(w for w, _ in results[raw_name])
    raw_r = max(rd for _, rd in results[raw_name])
    print(f"\n{size / 2**30:.2f} GiB, block {args.block_size} B, queue depth {args.queue_depth}, "
          f"threads {args.threads}, best of {args.rounds}")
    print("| | write GB/s | of raw | read GB/s | of raw |")
    print("|---|---|---|---|---|")
    for name, rows in results.items():
        w, rd = max(x for x, _ in rows), max(y for _, y in rows)
        print(f"| {name} | {w:.2f} | {100 * w / raw_w:.0f}% | {rd:.2f} | {100 * rd / raw_r:.0f}% |")


if __name__ == "__main__":
    main()
