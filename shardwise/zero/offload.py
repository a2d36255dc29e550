"""ZeRO-Offload to NVMe: optimizer state and fp32 master weights kept in files.

``NvmeStore`` owns a private folder under ``nvme_path`` and reads/writes
tensors with ``os.preadv``/``os.pwritev`` on a thread pool (``aio.thread_count``
threads, ``aio.block_size`` per call), so I/O overlaps compute.  The folder is
removed when the engine is garbage-collected or the process exits.

``OptimizerSwapper`` cuts this rank's optimizer fragments into sub-groups of
at most ``sub_group_size`` elements.  Outside the optimizer step nothing of
them is resident: each fragment's tensor is empty and its per-element
optimizer states are empty placeholders.  ``batches()`` swaps sub-groups in
one after the other (reading the next ones ahead, at most ``buffer_count``
resident), yields each, then writes it back and frees it.
"""

from __future__ import annotations

import atexit
import os
import shutil
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from shardwise.malloc import return_large_frees_to_the_os


def _bytes_view(t: torch.Tensor) -> memoryview:
    return memoryview(t.detach().view(torch.uint8).numpy()) if t.numel() else memoryview(b"")


class NvmeStore:
    def __init__(self, root: str, *, rank: int, threads: int = 1, block_size: int = 1 << 20) -> None:
        if not root:
            raise ValueError("offload to nvme needs 'nvme_path' (a folder on a fast local disk)")
        return_large_frees_to_the_os()
        base = Path(root)
        base.mkdir(parents=True, exist_ok=True)
        self.dir = base / f"shardwise-{os.getpid()}-rank{rank}"
        self.dir.mkdir(exist_ok=True)
        self.block = block_size
        self.pool = ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="shardwise-nvme")
        self._fds: dict[str, int] = {}
        self._closer = weakref.finalize(self, NvmeStore._cleanup, self.pool, self._fds, self.dir)
        atexit.register(self._closer)

    @staticmethod
    def _cleanup(pool, fds, folder) -> None:
        pool.shutdown(wait=True)
        for fd in fds.values():
            os.close(fd)
        fds.clear()
        shutil.rmtree(folder, ignore_errors=True)

    def close(self) -> None:
        self._closer()

    def _fd(self, name: str) -> int:
        if name not in self._fds:
            self._fds[name] = os.open(self.dir / name, os.O_RDWR | os.O_CREAT, 0o600)
        return self._fds[name]

    def _write(self, name: str, tensor: torch.Tensor, offset: int) -> None:
        fd, view, done = self._fd(name), _bytes_view(tensor), 0
        while done < len(view):
            done += os.pwritev(fd, [view[done : done + self.block]], offset + done)

    def _read(self, name: str, out: torch.Tensor, offset: int) -> None:
        fd, view, done = self._fd(name), _bytes_view(out), 0
        while done < len(view):
            n = os.preadv(fd, [view[done : done + self.block]], offset + done)
            if n == 0:
                raise OSError(f"{self.dir / name}: file ends at byte {offset + done}, expected {offset + len(view)}")
            done += n

    def write_async(self, name: str, tensor: torch.Tensor, offset: int = 0) -> Future:
        return self.pool.submit(self._write, name, tensor, offset)  # the closure keeps ``tensor`` alive

    def read_async(self, name: str, out: torch.Tensor, offset: int = 0) -> Future:
        return self.pool.submit(self._read, name, out, offset)

    def disk_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.dir.iterdir()) if self.dir.exists() else 0


class _SubGroup:
    def __init__(self, index: int, frags: list) -> None:
        self.index = index
        self.frags = frags
        self.numel = sum(f.numel for f in frags)
        self.file = f"subgroup{index}.bin"
        self.state_keys: list[tuple[str, torch.dtype]] = []  # per-element optimizer states, once known


class OptimizerSwapper:
    def __init__(self, store: NvmeStore, optimizer, fragments: list, *, sub_group_size: int,
                 buffer_count: int, initial_value) -> None:
        self.store = store
        self.optimizer = optimizer
        self.ahead = max(1, buffer_count - 1)
        self.subgroups: list[_SubGroup] = []
        current, size = [], 0
        for f in fragments:
            if current and size + f.numel > sub_group_size:
                self.subgroups.append(_SubGroup(len(self.subgroups), current))
                current, size = [], 0
            current.append(f)
            size += f.numel
        if current:
            self.subgroups.append(_SubGroup(len(self.subgroups), current))
        for sg in self.subgroups:  # write the initial fp32 weights, one sub-group at a time
            buf = torch.cat([initial_value(f).reshape(-1).to(torch.float32) for f in sg.frags])
            store.write_async(sg.file, buf).result()
            for f in sg.frags:
                f.tensor.data = torch.empty(0, dtype=torch.float32)

    def _layout(self, sg: _SubGroup):
        """(key, dtype, byte offset) of each per-element array in the sub-group's file."""
        out, offset = [("master", torch.float32, 0)], sg.numel * 4
        for key, dtype in sg.state_keys:
            out.append((key, dtype, offset))
            offset += sg.numel * torch.tensor([], dtype=dtype).element_size()
        return out

    def _swap_in(self, sg: _SubGroup) -> tuple[dict, list[Future]]:
        bufs, futures = {}, []
        for key, dtype, offset in self._layout(sg):
            bufs[key] = torch.empty(sg.numel, dtype=dtype)
            futures.append(self.store.read_async(sg.file, bufs[key], offset))
        return bufs, futures

    def _attach(self, sg: _SubGroup, bufs: dict) -> None:
        pos = 0
        for f in sg.frags:
            f.tensor.data = bufs["master"][pos : pos + f.numel]
            for key, _ in sg.state_keys:
                self.optimizer.state[f.tensor][key] = bufs[key][pos : pos + f.numel]
            pos += f.numel

    def _swap_out(self, sg: _SubGroup, bufs: dict) -> list[Future]:
        if not sg.state_keys and self.optimizer is not None:  # first step: the optimizer created its states
            state = self.optimizer.state.get(sg.frags[0].tensor, {})
            sg.state_keys = [(k, v.dtype) for k, v in state.items()
                             if k != "step" and isinstance(v, torch.Tensor) and v.numel() == sg.frags[0].numel]
            for key, dtype in sg.state_keys:
                bufs[key] = torch.cat([self.optimizer.state[f.tensor][key].reshape(-1) for f in sg.frags])
        else:  # states normally live in the buffers; a checkpoint load may have replaced them
            pos = 0
            for f in sg.frags:
                for key, _ in sg.state_keys:
                    value = self.optimizer.state[f.tensor][key]
                    target = bufs[key][pos : pos + f.numel]
                    if value.data_ptr() != target.data_ptr():
                        target.copy_(value.reshape(-1))
                pos += f.numel
        futures = [self.store.write_async(sg.file, bufs[key], offset) for key, _, offset in self._layout(sg)]
        for f in sg.frags:
            f.tensor.data = torch.empty(0, dtype=torch.float32)
            state = self.optimizer.state.get(f.tensor) if self.optimizer is not None else None
            for key, dtype in sg.state_keys:
                state[key] = torch.empty(0, dtype=dtype)
        return futures

    def batches(self, subgroups: list[_SubGroup] | None = None):
        """Yield each sub-group's fragments with their weights and states resident (reads ahead)."""
        order = list(subgroups if subgroups is not None else self.subgroups)
        pending = {}
        writes: list[Future] = []
        for i, sg in enumerate(order):
            for nxt in order[i : i + self.ahead + 1]:
                if nxt.index not in pending:
                    pending[nxt.index] = self._swap_in(nxt)
            bufs, reads = pending.pop(sg.index)
            for r in reads:
                r.result()
            self._attach(sg, bufs)
            try:
                yield sg.frags
            finally:
                writes.extend(self._swap_out(sg, bufs))
                for w in [w for w in writes if w.done()]:
                    w.result()  # surface an I/O error now
                writes = [w for w in writes if not w.done()]
        for w in writes:
            w.result()
