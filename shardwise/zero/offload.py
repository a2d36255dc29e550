"""ZeRO-Offload to NVMe: optimizer state and fp32 master weights kept in files.

``NvmeStore`` (``shardwise.zero.nvme_io``) owns a private folder under ``nvme_path``
and reads/writes tensors with O_DIRECT on a thread pool (``aio`` block size, queue
depth, threads), so I/O overlaps compute.  The folder is removed when the engine is
garbage-collected or the process exits.

``OptimizerSwapper`` cuts this rank's optimizer fragments into sub-groups of
at most ``sub_group_size`` elements.  Outside the optimizer step nothing of
them is resident: each fragment's tensor is empty and its per-element
optimizer states are empty placeholders.  ``batches()`` swaps sub-groups in
one after the other (reading the next ones ahead, at most ``buffer_count``
resident), yields each, then writes it back and frees it.
"""

from __future__ import annotations

from concurrent.futures import Future

import torch

from shardwise.zero.nvme_io import ALIGN, NvmeStore  # noqa: F401  (NvmeStore: imported from here by the stages)


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
        out, offset = [("master", torch.float32, 0)], -(-sg.numel * 4 // ALIGN) * ALIGN
        for key, dtype in sg.state_keys:  # each array starts on an ALIGN boundary (O_DIRECT)
            out.append((key, dtype, offset))
            offset += -(-sg.numel * torch.tensor([], dtype=dtype).element_size() // ALIGN) * ALIGN
        return out

    def _swap_in(self, sg: _SubGroup) -> tuple[dict, list[Future]]:
        bufs, futures = {}, []
        for key, dtype, offset in self._layout(sg):
            bufs[key] = self.store.empty(sg.numel, dtype)
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
