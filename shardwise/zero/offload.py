"""ZeRO-Offload to NVMe: optimizer state and fp32 master weights kept in files.

``NvmeStore`` (``shardwise.zero.nvme_io``) owns a private folder under ``nvme_path``
and reads/writes tensors with O_DIRECT on a thread pool (``aio`` block size, queue
depth, threads), so I/O overlaps compute.  The folder is removed when the engine is
garbage-collected or the process exits.

``OptimizerSwapper`` cuts this rank's optimizer fragments into sub-groups of
at most ``sub_group_size`` elements.  Outside the optimizer step nothing of
them is resident: each fragment's tensor is empty and its per-element
optimizer states are empty placeholders.  ``batches()`` swaps sub-groups in
one after the other and yields each while the next ones are read and the
previous ones written:

- a sub-group's file mirrors its in-memory layout (fp32 weights, then each
  per-element state, every array on an ``ALIGN`` boundary), so swapping in or
  out is one request for the whole sub-group;
- it is read into, stepped in and written from one of ``max(3, buffer_count)``
  page-aligned *slots* allocated once (grown only when the first step creates the
  optimizer states) and reused every step: while sub-group k is yielded, the
  reads of k+1 .. k+slots-2 and the write of k-1 are in flight; the read of
  k+slots-2 reuses k-2's slot once its write is done.
"""

from __future__ import annotations

import time
from concurrent.futures import Future

import torch

from shardwise.zero.nvme_io import ALIGN, NvmeStore, empty_aligned  # noqa: F401  (NvmeStore: imported from here)


def cut_subgroups(fragments: list, size: int) -> list[list]:
    """Consecutive runs of ``fragments`` of at most ``size`` elements (a bigger fragment is alone)."""
    out, current, n = [], [], 0
    for f in fragments:
        if current and n + f.numel > size:
            out.append(current)
            current, n = [], 0
        current.append(f)
        n += f.numel
    if current:
        out.append(current)
    return out


class StepTrace:
    """What the offloaded step did and when (``time.perf_counter()``), for tests and profiling:
    ``(time, event, sub-group)`` with events ``read`` / ``write`` (request issued), ``step_start`` /
    ``step_end`` (a sub-group's optimizer step) and ``backward_end`` (sub-group -1).  Cleared at the
    start of each optimizer step (or of the backward it overlaps)."""

    def __init__(self) -> None:
        self.events: list[tuple[float, str, int]] = []

    def record(self, event: str, index: int = -1) -> None:
        self.events.append((time.perf_counter(), event, index))

    def clear(self) -> None:
        self.events = []

    def first(self, event: str, index: int = -1) -> float | None:
        return next((t for t, e, i in self.events if e == event and (index < 0 or i == index)), None)


class _SubGroup:
    def __init__(self, index: int, frags: list) -> None:
        self.index = index
        self.frags = frags
        self.numel = sum(f.numel for f in frags)
        self.file = f"subgroup{index}.bin"
        self.state_keys: list[tuple[str, torch.dtype]] = []  # per-element optimizer states, once known


class _Slot:
    """A reusable page-aligned buffer holding one sub-group's file image, and its write in flight."""

    def __init__(self) -> None:
        self.buf = torch.empty(0, dtype=torch.uint8)
        self.write: Future | None = None

    def ensure(self, nbytes: int, keep: int = 0) -> None:
        if self.buf.numel() < nbytes:
            new = empty_aligned(nbytes, torch.uint8)
            if keep:
                new[:keep].copy_(self.buf[:keep])
            self.buf = new

    def idle(self) -> None:
        if self.write is not None:
            self.write.result()
            self.write = None


class OptimizerSwapper:
    def __init__(self, store: NvmeStore, optimizer, fragments: list, *, sub_group_size: int,
                 buffer_count: int, initial_value) -> None:
        self.store = store
        self.optimizer = optimizer
        self.slots = [_Slot() for _ in range(max(3, int(buffer_count)))]
        self.ahead = len(self.slots) - 2  # reads in flight beyond the sub-group being stepped
        self._next_slot = 0
        self.trace = StepTrace()
        self.subgroups = [_SubGroup(i, frags) for i, frags in enumerate(cut_subgroups(fragments, sub_group_size))]
        for sg in self.subgroups:  # write the initial fp32 weights, one sub-group at a time
            buf = empty_aligned(sg.numel, torch.float32)
            torch.cat([initial_value(f).reshape(-1).to(torch.float32) for f in sg.frags], out=buf)
            store.write_async(sg.file, buf).result()
            for f in sg.frags:
                f.tensor.data = torch.empty(0, dtype=torch.float32)

    def _layout(self, sg: _SubGroup) -> tuple[list[tuple[str, torch.dtype, int]], int]:
        """(key, dtype, byte offset) of each per-element array in the sub-group's file, and its size."""
        out, offset = [("master", torch.float32, 0)], -(-sg.numel * 4 // ALIGN) * ALIGN
        for key, dtype in sg.state_keys:  # each array starts on an ALIGN boundary (O_DIRECT)
            out.append((key, dtype, offset))
            offset += -(-sg.numel * torch.tensor([], dtype=dtype).element_size() // ALIGN) * ALIGN
        return out, offset

    def _views(self, sg: _SubGroup, slot: _Slot) -> dict[str, torch.Tensor]:
        layout, _ = self._layout(sg)
        return {key: slot.buf[off:off + sg.numel * torch.tensor([], dtype=dtype).element_size()].view(dtype)
                for key, dtype, off in layout}

    def _swap_in(self, sg: _SubGroup) -> tuple[_Slot, Future]:
        slot = self.slots[self._next_slot % len(self.slots)]
        self._next_slot += 1
        slot.idle()  # its previous sub-group's write must be done before the slot is refilled
        _, nbytes = self._layout(sg)
        slot.ensure(nbytes)
        self.trace.record("read", sg.index)
        return slot, self.store.read_async(sg.file, slot.buf[:nbytes])

    def _attach(self, sg: _SubGroup, slot: _Slot) -> None:
        bufs, pos = self._views(sg, slot), 0
        for f in sg.frags:
            f.tensor.data = bufs["master"][pos : pos + f.numel]
            for key, _ in sg.state_keys:
                self.optimizer.state[f.tensor][key] = bufs[key][pos : pos + f.numel]
            pos += f.numel

    def _swap_out(self, sg: _SubGroup, slot: _Slot) -> None:
        if not sg.state_keys and self.optimizer is not None:  # first step: the optimizer created its states
            state = self.optimizer.state.get(sg.frags[0].tensor, {})
            sg.state_keys = [(k, v.dtype) for k, v in state.items()
                             if k != "step" and isinstance(v, torch.Tensor) and v.numel() == sg.frags[0].numel]
            if sg.state_keys:  # (only now the slot's size is known; the stepped weights move along)
                slot.ensure(self._layout(sg)[1], keep=sg.numel * 4)
        bufs, pos = self._views(sg, slot), 0
        for f in sg.frags:  # states normally live in the slot; a first step or a checkpoint load made new ones
            if f.tensor.data_ptr() != bufs["master"][pos:].data_ptr():
                bufs["master"][pos : pos + f.numel].copy_(f.tensor.detach().reshape(-1))
            for key, _ in sg.state_keys:
                value = self.optimizer.state[f.tensor][key]
                target = bufs[key][pos : pos + f.numel]
                if value.data_ptr() != target.data_ptr():
                    target.copy_(value.reshape(-1))
            pos += f.numel
        self.trace.record("write", sg.index)
        slot.write = self.store.write_async(sg.file, slot.buf[:self._layout(sg)[1]])
        for f in sg.frags:
            f.tensor.data = torch.empty(0, dtype=torch.float32)
            state = self.optimizer.state.get(f.tensor) if self.optimizer is not None else None
            for key, dtype in sg.state_keys:
                state[key] = torch.empty(0, dtype=dtype)

    def batches(self, subgroups: list[_SubGroup] | None = None):
        """Yield each sub-group's fragments with their weights and states resident (reads ahead, writes
        behind).  Every request is finished when the generator ends, however it ends."""
        order = list(subgroups if subgroups is not None else self.subgroups)
        pending: dict[int, tuple[_Slot, Future]] = {}
        try:
            for i, sg in enumerate(order):
                for nxt in order[i : i + self.ahead + 1]:
                    if nxt.index not in pending:
                        pending[nxt.index] = self._swap_in(nxt)
                slot, read = pending.pop(sg.index)
                read.result()
                self._attach(sg, slot)
                try:
                    yield sg.frags
                finally:
                    self._swap_out(sg, slot)
                for s in self.slots:  # surface an I/O error now
                    if s.write is not None and s.write.done():
                        s.idle()
        finally:
            for _, read in pending.values():
                read.exception()  # wait: the slot must not be refilled under a read in flight
            for s in self.slots:
                s.idle()
