"""NVMe swap I/O at the disk's bandwidth: O_DIRECT, aligned buffers, ``aio`` block size and queue depth.

``NvmeStore`` keeps the interface of the first implementation (``write_async`` /
``read_async`` of a tensor at a byte offset of a named file, ``disk_bytes``, ``close``;
a private folder under ``nvme_path`` removed at exit) and changes how the bytes move:

- requests move in ``aio.block_size`` calls, up to ``thread_count x queue_depth`` of them
  in flight at once on a thread pool (``os.preadv`` / ``os.pwritev`` release the GIL), which
  is how DeepSpeed's ``aio`` block reads them; a request's body is cut into one run of
  whole blocks per worker, so a large request costs a few Python tasks, not one per block;
- files are opened with ``O_DIRECT`` where the filesystem allows it, so swap traffic
  neither fills the page cache (the memory ZeRO-Infinity is trying to save) nor is
  measured at page-cache speed.  ``O_DIRECT`` needs the file offset, the length and the
  memory address aligned to ``ALIGN``: the aligned body of a request goes straight from
  or into the tensor's memory when the tensor is aligned (``empty()`` hands out such
  tensors), or through a reused aligned bounce buffer per worker when it is not; an
  unaligned head or tail (a region not starting or ending on ``ALIGN``) goes through the
  page cache on a second descriptor.  So any offset and length are correct; aligned ones
  are fast.

An io_uring binding was not used: on this machine the thread pool already reaches the
disk's ``fio`` bandwidth (``benchmarks/nvme_bandwidth.py``), and Python's maintained
bindings would add a dependency for no gain.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from shardwise.malloc import return_large_frees_to_the_os

ALIGN = 4096  # O_DIRECT alignment of offsets, lengths and addresses (a page; enough for 512 B and 4 KiB disks)


def _round_down(x: int) -> int:
    return x - x % ALIGN


def _round_up(x: int) -> int:
    return -(-x // ALIGN) * ALIGN


def empty_aligned(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A 1-d tensor whose storage starts on an ``ALIGN`` boundary (for zero-copy O_DIRECT)."""
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8)
    start = (-raw.data_ptr()) % ALIGN
    return raw[start:start + nbytes].view(dtype)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8)


class IoStats:
    """Per-process totals of swap traffic and of the time callers spent blocked on it."""

    def __init__(self) -> None:
        self.read_bytes = 0
        self.write_bytes = 0
        self.wait_seconds = 0.0

    def snapshot(self) -> tuple[int, int, float]:
        return self.read_bytes, self.write_bytes, self.wait_seconds


STATS = IoStats()


class _TimedFuture(Future):
    """A Future whose ``result()`` adds the time the caller was blocked to ``STATS.wait_seconds``."""

    def result(self, timeout=None):
        if self.done():
            return super().result(timeout)
        t0 = time.perf_counter()
        try:
            return super().result(timeout)
        finally:
            STATS.wait_seconds += time.perf_counter() - t0


class _Gather:
    """One Future for a request cut into ``count`` pieces."""

    def __init__(self, count: int) -> None:
        self.future: Future = _TimedFuture()
        self._left = count
        self._lock = threading.Lock()
        if count == 0:
            self.future.set_result(None)

    def piece_done(self, piece: Future) -> None:
        err = piece.exception()
        with self._lock:
            if self.future.done():
                return
            if err is not None:
                self.future.set_exception(err)
                return
            self._left -= 1
            if self._left == 0:
                self.future.set_result(None)


class NvmeStore:
    def __init__(self, root: str, *, rank: int, threads: int = 1, block_size: int = 1 << 20, queue_depth: int = 8,
                 direct: bool = True) -> None:
        if not root:
            raise ValueError("offload to nvme needs 'nvme_path' (a folder on a fast local disk)")
        return_large_frees_to_the_os()
        base = Path(root)
        base.mkdir(parents=True, exist_ok=True)
        # A folder of its own (two engines of one process, or a ZeRO-3 engine's parameter and optimizer
        # stores, never share one: closing a store removes its folder while the others still use theirs).
        self.dir = Path(tempfile.mkdtemp(prefix=f"shardwise-{os.getpid()}-rank{rank}-", dir=base))
        self.block = max(ALIGN, _round_down(int(block_size)))
        self.workers = max(1, int(threads)) * max(1, int(queue_depth))
        self.pool = ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="shardwise-nvme")
        self.direct = direct and hasattr(os, "O_DIRECT") and self._direct_works()
        self._fds: dict[tuple[str, bool], int] = {}
        self._fd_lock = threading.RLock()
        self._allocated: dict[str, int] = {}  # bytes reserved per file
        self._local = threading.local()
        # (runs when the store goes, at close(), or at exit: weakref.finalize's atexit)
        self._closer = weakref.finalize(self, NvmeStore._cleanup, self.pool, self._fds, self.dir)

    def _direct_works(self) -> bool:
        """Some filesystems (tmpfs, some overlays) refuse O_DIRECT: then everything is buffered."""
        probe = self.dir / ".direct-probe"
        try:
            fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
        except OSError:
            return False
        try:
            buf = _bytes(empty_aligned(ALIGN, torch.uint8))
            return os.pwritev(fd, [memoryview(buf.numpy())], 0) == ALIGN
        except OSError:
            return False
        finally:
            os.close(fd)
            probe.unlink(missing_ok=True)

    @staticmethod
    def _cleanup(pool, fds, folder) -> None:
        pool.shutdown(wait=True)
        for fd in fds.values():
            os.close(fd)
        fds.clear()
        shutil.rmtree(folder, ignore_errors=True)

    def close(self) -> None:
        self._closer()

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A buffer this store reads into and writes from without a copy."""
        return empty_aligned(numel, dtype)

    def _fd(self, name: str, direct: bool) -> int:
        key = (name, direct)
        fd = self._fds.get(key)
        if fd is None:
            with self._fd_lock:
                fd = self._fds.get(key)
                if fd is None:
                    flags = os.O_RDWR | os.O_CREAT | (os.O_DIRECT if direct else 0)
                    fd = self._fds[key] = os.open(self.dir / name, flags, 0o600)
        return fd

    def _bounce(self) -> torch.Tensor:
        buf = getattr(self._local, "buf", None)
        if buf is None:
            buf = self._local.buf = _bytes(empty_aligned(self.block, torch.uint8))
        return buf

    # -- one piece: runs on a worker thread ---------------------------------------------------
    def _piece(self, name: str, data: torch.Tensor, offset: int, write: bool) -> None:
        """Move ``data`` (uint8) to/from ``offset``: O_DIRECT when aligned, else through the page cache."""
        n = data.numel()
        aligned = self.direct and offset % ALIGN == 0 and n % ALIGN == 0
        fd = self._fd(name, aligned)
        if aligned and data.data_ptr() % ALIGN:  # unaligned memory: through the bounce buffer
            bounce = self._bounce()[:n]
            if write:
                bounce.copy_(data)
                self._all(fd, bounce, offset, write=True, name=name)
            else:
                self._all(fd, bounce, offset, write=False, name=name)
                data.copy_(bounce)
            return
        self._all(fd, data, offset, write=write, name=name)

    def _run(self, name: str, data: torch.Tensor, offset: int, write: bool) -> None:
        """One block per call: a head or tail (smaller than a page-aligned block) is one call."""
        for a in range(0, data.numel(), self.block):
            self._piece(name, data[a:a + self.block], offset + a, write)

    def _all(self, fd: int, data: torch.Tensor, offset: int, *, write: bool, name: str) -> None:
        view, done = memoryview(data.numpy()), 0
        while done < len(view):
            if write:
                k = os.pwritev(fd, [view[done:]], offset + done)
            else:
                k = os.preadv(fd, [view[done:]], offset + done)
                if k == 0:
                    raise OSError(f"{self.dir / name}: file ends at byte {offset + done}, "
                                  f"expected {offset + len(view)}")
            done += k

    def _submit(self, name: str, tensor: torch.Tensor, offset: int, write: bool) -> Future:
        data = _bytes(tensor) if tensor.numel() else torch.empty(0, dtype=torch.uint8)
        end = offset + data.numel()
        # Spans: an unaligned head, the aligned body cut into at most one run of whole blocks per
        # worker (each worker moves its run one block per call), an unaligned tail.  Few Python
        # tasks per request, and up to ``workers`` blocks in flight.
        body_start, body_end = _round_up(offset), _round_down(end)
        if body_start >= body_end:
            spans = [(offset, end)]
        else:
            blocks = -(-(body_end - body_start) // self.block)
            per = -(-blocks // min(self.workers, blocks)) * self.block
            spans = [(offset, body_start)]
            spans += [(a, min(a + per, body_end)) for a in range(body_start, body_end, per)]
            spans.append((body_end, end))
        spans = [(a, b) for a, b in spans if b > a]
        if write:
            STATS.write_bytes += end - offset
        else:
            STATS.read_bytes += end - offset
        gather = _Gather(len(spans))
        # ``tensor`` stays referenced by the submitted closures until every piece is done.
        for a, b in spans:
            piece = self.pool.submit(self._run, name, data[a - offset:b - offset], a, write)
            piece.add_done_callback(gather.piece_done)
        return gather.future

    def write_async(self, name: str, tensor: torch.Tensor, offset: int = 0) -> Future:
        end = offset + tensor.numel() * tensor.element_size()
        if end > self._allocated.get(name, 0):
            # Reserve the extent first (as fio does): block allocation inside many concurrent
            # O_DIRECT writes that extend the file is several times slower than rewriting.
            with self._fd_lock:
                if end > self._allocated.get(name, 0):
                    try:
                        os.posix_fallocate(self._fd(name, False), 0, _round_up(end))
                    except OSError:  # not supported here: the writes allocate as they go
                        pass
                    self._allocated[name] = _round_up(end)
        return self._submit(name, tensor, offset, write=True)

    def read_async(self, name: str, out: torch.Tensor, offset: int = 0) -> Future:
        return self._submit(name, out, offset, write=False)

    def disk_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.dir.iterdir()) if self.dir.exists() else 0
