"""Reduce-scatter and all-gather as direct point-to-point exchanges (gloo, CPU tensors).

gloo's own ``reduce_scatter`` and ``all_gather`` are slow on a CPU: with 3.2 MiB on 2 ranks
its reduce-scatter takes longer than an all-reduce of the whole buffer (5.6 vs 3.8 ms) and its
all-gather 3.1 ms, whereas sending each peer its chunk directly takes 2.6 ms (reduce-scatter)
and 1.8 ms (all-gather); at 4 ranks 5.0 and 3.8 ms against gloo's 11.4 and 7.1 ms
(``benchmarks/gloo_collectives.py``, docs/benchmarks.md).  With these, ZeRO's reduce-scatter +
all-gather costs about what one all-reduce costs, as on NCCL.

Every rank posts a receive from and a send to every other rank of the group (all at once,
asynchronously), so the exchange takes one round; for the group sizes data parallelism has
on CPUs that beats a ring.  The reduce-scatter sums the chunks in rank order
(``c0 + c1 + ... + c[n-1]``), whichever rank owns the result, so it is deterministic.

Used by ``shardwise.comm.reduce_scatter_tensor`` / ``all_gather_into_tensor`` when the group
is gloo, the tensors are on the CPU, the op is a sum and the group has at most
``MAX_WORLD`` ranks.  ``SHARDWISE_DIRECT_COLLECTIVES=0`` turns it off (gloo's own
collectives then run); ``=1`` uses it for any group size.
"""

from __future__ import annotations

import datetime
import os
import time

import torch
import torch.distributed as dist

from shardwise.comm import ops

MAX_WORLD = 16
TAG = 0x5357  # p2p tag of these exchanges; messages with one tag between two ranks arrive in order
_ENV = "SHARDWISE_DIRECT_COLLECTIVES"


def enabled(group, *tensors: torch.Tensor) -> bool:
    """Whether the direct exchange replaces the backend's collective for these tensors."""
    switch = os.environ.get(_ENV, "")
    if switch == "0" or not dist.is_initialized() or dist.get_backend(group) != "gloo":
        return False
    if any(t.device.type != "cpu" or not t.is_contiguous() for t in tensors):
        return False
    size = dist.get_world_size(group)
    return size > 1 and (switch == "1" or size <= MAX_WORLD)


class DirectWork:
    """Handle of an exchange in flight; ``wait()`` completes the transfers and the local sum.

    The transfers are bounded by the collective timeout (``shardwise.comm.configure``), counted
    from when the exchange was issued, like the backend's own collectives: a point-to-point
    wait would otherwise use the timeout its process group was created with."""

    def __init__(self, works: list, finish=None) -> None:
        self._works = works
        self._finish = finish
        self._future: torch.futures.Future = torch.futures.Future()
        limit = ops.timeout
        self._deadline = time.monotonic() + limit.total_seconds() if limit is not None else None

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        if self._future.done():
            return True
        deadline = self._deadline if timeout is None else time.monotonic() + timeout.total_seconds()
        for w in self._works:
            if deadline is None:
                w.wait()
            else:
                w.wait(datetime.timedelta(seconds=max(deadline - time.monotonic(), 0.001)))
        if self._finish is not None:
            self._finish()
        self._works, self._finish = [], None
        self._future.set_result(None)
        return True

    def is_completed(self) -> bool:
        return self._future.done()

    def get_future(self) -> torch.futures.Future:
        """Completes when ``wait()`` has finished the exchange (the comms logger's end time)."""
        return self._future


def _peers(group) -> tuple[int, list[tuple[int, int]]]:
    """This rank's index in ``group`` and (group rank, global rank) of every other member."""
    me = dist.get_rank(group)
    n = dist.get_world_size(group)
    glob = (lambda r: r) if group is None else (lambda r: dist.get_global_rank(group, r))
    return me, [(r, glob(r)) for r in range(n) if r != me]


def _peers_for(op: str, group, *, whole: int, chunk: int, names: tuple[str, str]):
    """``_peers(group)`` once the sizes are checked: the whole buffer is one chunk per rank."""
    me, peers = _peers(group)
    n = len(peers) + 1
    if whole != n * chunk:
        raise ValueError(f"{op}: {names[0]} has {whole} elements, expected {n} ranks x {chunk} "
                         f"{names[1]} elements")
    return me, peers


def _issued(work: DirectWork, async_op: bool):
    """The handle for ``async_op``; otherwise the exchange completed, like a blocking collective."""
    if async_op:
        return work
    work.wait()
    return None


def reduce_scatter(output: torch.Tensor, tensor: torch.Tensor, group=None, async_op: bool = False):
    """``output`` = this rank's chunk of the sum of ``tensor`` over the group (``output`` may be
    that chunk of ``tensor`` itself)."""
    size = output.numel()
    me, peers = _peers_for("reduce_scatter", group, whole=tensor.numel(), chunk=size, names=("input", "output"))
    n = len(peers) + 1
    flat = tensor.view(-1)
    out = output.view(-1)
    recv = torch.empty((n - 1) * size, dtype=tensor.dtype, device=tensor.device)
    rows = {r: recv[k * size : (k + 1) * size] for k, (r, _) in enumerate(peers)}
    works = [dist.irecv(rows[r], src=g, group=group, tag=TAG) for r, g in peers]
    works += [dist.isend(flat[r * size : (r + 1) * size], dst=g, group=group, tag=TAG) for r, g in peers]

    def finish() -> None:
        mine = flat[me * size : (me + 1) * size]
        if me > 0:  # (c0 + ... + c[me-1]) in the first row, then + c[me]: addition commutes exactly
            lower = rows[0]
            for r in range(1, me):
                lower.add_(rows[r])
            torch.add(mine, lower, out=out)
        elif out.data_ptr() != mine.data_ptr():
            out.copy_(mine)
        for r in range(me + 1, n):
            out.add_(rows[r])

    return _issued(DirectWork(works, finish), async_op)


def all_gather(output: torch.Tensor, tensor: torch.Tensor, group=None, async_op: bool = False):
    """``output`` = the ranks' ``tensor`` end to end, in rank order (``tensor`` may already be this
    rank's chunk of ``output``)."""
    size = tensor.numel()
    me, peers = _peers_for("all_gather", group, whole=output.numel(), chunk=size, names=("output", "input"))
    flat = output.view(-1)
    src = tensor.view(-1)
    mine = flat[me * size : (me + 1) * size]
    if mine.data_ptr() != src.data_ptr():
        mine.copy_(src)
    works = [dist.irecv(flat[r * size : (r + 1) * size], src=g, group=group, tag=TAG) for r, g in peers]
    works += [dist.isend(src, dst=g, group=group, tag=TAG) for r, g in peers]
    return _issued(DirectWork(works), async_op)
