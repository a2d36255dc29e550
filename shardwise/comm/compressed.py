"""1-bit compressed all-reduce with error feedback (the exchange of 1-bit Adam, 0/1 Adam, 1-bit LAMB).

Every rank holds a flat fp32 buffer (its momentum, say) and wants the average over the group.
Instead of 32 bits per element, each element travels as one sign bit, twice:

1. **worker side**: add this rank's *worker error* (what compression lost last time) to the
   buffer and cut it into one chunk per rank. Each chunk's share of each tensor (a *segment*;
   one tensor: one segment per chunk) is replaced by ``scale * sign``, ``scale`` being the
   segment's root mean square (so it keeps its L2 norm). What that loses becomes the new worker
   error. The signs are packed 8 per byte, followed by the chunk's scales (4 bytes each); an
   **all-to-all** sends chunk j to rank j.
2. **server side**: rank j unpacks the n versions of its chunk, averages ``scale_i * sign_i``,
   adds its *server error*, compresses the result the same way, keeps the loss as the new server
   error, and an **all-gather** of the packed chunks gives every rank the whole averaged buffer.

Error feedback makes the compression unbiased over time: with errors starting at zero, the
sum of the outputs over T calls equals the sum of the true averages minus (the mean of the
ranks' worker errors + the server error) after call T, elementwise, so nothing is lost, only
delayed (``tests/test_onebit_comm.py`` checks that identity and that the errors stay bounded).

Per element, each rank sends (n-1)/n bits in each phase instead of the 2(n-1)/n x 32 bits of a
ring all-reduce: 32x less, plus 4 bytes per segment for the scales. DeepSpeed does the same in
``runtime/comm/{nccl,compressed}.py``, one call per tensor with one worker scale per tensor and one
server scale per chunk, using cupy / a CUDA kernel for the bit packing; here all tensors go in one
call (two collectives per step) with a scale per segment, and the packing is plain torch bit
arithmetic, so one code path serves gloo (CPU) and NCCL (GPU). +0 counts as positive, as in
DeepSpeed (-0 counts as negative here).

Both collectives go through ``ops.run`` under their own names (``compressed_all_to_all``,
``compressed_all_gather``), so the comms logger shows them with the bytes actually sent.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from shardwise.comm import direct, ops

__all__ = ["padded_size", "pack_signs", "unpack_signs", "error_buffers", "compressed_all_reduce",
           "message_bytes", "check_backend"]

_SCALE_BYTES = 4  # one float32 scale after each chunk's packed signs


def padded_size(numel: int, world_size: int) -> int:
    """Length of the worker error buffer for a ``numel``-element tensor: a multiple of 8 x ranks,
    so each rank's chunk packs into whole bytes."""
    unit = 8 * world_size
    return max(unit, -(-numel // unit) * unit)


def error_buffers(numel: int, world_size: int, *, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Fresh (worker error, server error) for a ``numel``-element buffer on ``world_size`` ranks."""
    padded = padded_size(numel, world_size)
    return (torch.zeros(padded, dtype=torch.float32, device=device),
            torch.zeros(padded // world_size, dtype=torch.float32, device=device))


def message_bytes(numel: int, world_size: int, sizes: list[int] | None = None) -> int:
    """Bytes of each of the two messages (all-to-all input, all-gather output) for ``numel`` elements
    made of tensors of ``sizes`` elements (default: one tensor)."""
    return world_size * _layout(numel, world_size, tuple(sizes or (numel,))).row_bytes


class _Layout:
    """Where the scales go: one per *segment*, a segment being a chunk's share of one tensor.

    The flat buffer is padded and cut into one chunk per rank; tensor boundaries cut the chunks
    further. ``segments[j]`` lists chunk j's segments as ``(start, end, real)`` offsets within the
    chunk (``real`` < ``end - start`` where the segment runs into the padding); ``per_chunk`` is
    the largest number of segments in a chunk (every message row carries that many scales)."""

    def __init__(self, numel: int, n: int, sizes: tuple[int, ...]) -> None:
        padded = padded_size(numel, n)
        chunk = padded // n
        ends, total = set(), 0
        for size in sizes:
            total += size
            if 0 < total < numel:
                ends.add(total)
        self.segments = []
        for j in range(n):
            lo, hi = j * chunk, (j + 1) * chunk
            edges = [lo, *sorted(e for e in ends if lo < e < hi), hi]
            self.segments.append([(a - lo, b - lo, max(0, min(b, numel) - a)) for a, b in zip(edges, edges[1:])])
        self.chunk = chunk
        self.per_chunk = max(len(x) for x in self.segments)
        self.row_bytes = chunk // 8 + _SCALE_BYTES * self.per_chunk


_LAYOUTS: dict[tuple, _Layout] = {}


def _layout(numel: int, n: int, sizes: tuple[int, ...]) -> _Layout:
    key = (numel, n, sizes)
    found = _LAYOUTS.get(key)
    if found is None:
        if sum(sizes) != numel or any(s < 0 for s in sizes):
            raise ValueError(f"compressed_all_reduce: tensor sizes {list(sizes)} do not add up to {numel} elements")
        if len(_LAYOUTS) > 64:  # a few layouts per optimizer; never grow without bound
            _LAYOUTS.clear()
        found = _LAYOUTS[key] = _Layout(numel, n, sizes)
    return found


_WEIGHTS: dict[torch.device, torch.Tensor] = {}
_TABLES: dict[torch.device, torch.Tensor] = {}


def _bit_weights(device) -> torch.Tensor:
    w = _WEIGHTS.get(device)
    if w is None:
        w = _WEIGHTS[device] = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8, device=device)
    return w


_GATHER_BITS = 0x8040201008040201 - (1 << 64)  # as a signed int64: multiplying 8 bytes of 0/1 by it
# collects them, most significant first, into the top byte (no carries: each product bit is distinct)


def pack_signs(positive: torch.Tensor) -> torch.Tensor:
    """Pack a boolean tensor (last dimension a multiple of 8) into bytes, most significant bit first
    (``numpy.packbits`` order): ``[..., k]`` -> ``[..., k // 8]`` uint8. Each group of 8 bools is
    read as one int64 and its bits gathered with one multiplication."""
    if positive.shape[-1] % 8:
        raise ValueError(f"pack_signs: last dimension {positive.shape[-1]} is not a multiple of 8")
    lead = positive.shape[:-1]
    words = positive.contiguous().view(torch.uint8).reshape(*lead, -1, 8).view(torch.int64).squeeze(-1)
    return torch.bitwise_right_shift(words * _GATHER_BITS, 56).bitwise_and_(0xFF).to(torch.uint8)


def unpack_signs(packed: torch.Tensor) -> torch.Tensor:
    """``[..., m]`` uint8 -> ``[..., 8m]`` float32 of +1 (bit set) / -1 (a look-up of each byte's 8 signs)."""
    table = _TABLES.get(packed.device)
    if table is None:
        bits = torch.bitwise_and(torch.arange(256, dtype=torch.uint8).unsqueeze(-1), _bit_weights(torch.device("cpu")))
        table = _TABLES[packed.device] = ((bits != 0).to(torch.float32) * 2 - 1).to(packed.device)
    return torch.nn.functional.embedding(packed.reshape(-1).long(), table).reshape(*packed.shape[:-1], -1)


def _compress(rows: torch.Tensor, segments: list[list[tuple[int, int, int]]], per_chunk: int,
              error: torch.Tensor) -> torch.Tensor:
    """Rows ``[r, chunk]`` (row i cut into ``segments[i]``) -> packed signs and one scale per segment,
    ``[r, chunk/8 + 4 * per_chunk]`` uint8. A segment's scale is its root mean square (so
    ``scale * sign`` keeps its L2 norm). ``error`` (shaped like ``rows``, may be ``rows`` itself)
    becomes what was lost; padded positions carry no error."""
    packed = pack_signs(~torch.signbit(rows))  # +0 is positive; -0 is negative, like copysign below
    scales = torch.zeros(rows.shape[0], per_chunk, dtype=torch.float32, device=rows.device)
    for i, row_segments in enumerate(segments):
        for k, (a, b, real) in enumerate(row_segments):
            if real == 0:
                error[i, a:b] = 0.0
                continue
            seg = rows[i, a:b]
            scale = torch.linalg.vector_norm(seg).div_(math.sqrt(real))
            scales[i, k] = scale
            torch.sub(seg, torch.copysign(scale, seg), out=error[i, a:b])  # seg - scale * sign(seg)
            if real < b - a:
                error[i, a + real : b] = 0.0
    return torch.cat([packed, scales.view(torch.uint8)], dim=1)


def _decompress(message: torch.Tensor, segments: list[list[tuple[int, int, int]]], per_chunk: int) -> torch.Tensor:
    """``[r, chunk/8 + 4 * per_chunk]`` uint8 -> ``[r, chunk]`` float32 of ``scale * sign``."""
    cut = message.shape[1] - _SCALE_BYTES * per_chunk
    scales = message[:, cut:].contiguous().view(torch.float32)  # [r, per_chunk]
    out = unpack_signs(message[:, :cut])
    for i, row_segments in enumerate(segments):
        for k, (a, b, _) in enumerate(row_segments):
            out[i, a:b].mul_(scales[i, k])
    return out


def _all_to_all(output: torch.Tensor, tensor: torch.Tensor, group) -> None:
    ops.run("compressed_all_to_all", dist.all_to_all_single, (output, tensor), {"group": group},
            group=group, tensors=(tensor,), nbytes=tensor.numel() * tensor.element_size())


def _all_gather(output: torch.Tensor, tensor: torch.Tensor, group) -> None:
    impl = direct.all_gather if direct.enabled(group, output, tensor) else dist.all_gather_into_tensor
    ops.run("compressed_all_gather", impl, (output, tensor), {"group": group},
            group=group, tensors=(tensor,), nbytes=output.numel() * output.element_size())


def compressed_all_reduce(tensor: torch.Tensor, worker_error: torch.Tensor, server_error: torch.Tensor,
                          group=None, *, sizes: list[int] | None = None) -> torch.Tensor:
    """Replace ``tensor`` (any shape, floating point) by the 1-bit compressed average over ``group``.

    ``sizes``: when ``tensor`` is several tensors end to end, their element counts, so each gets its
    own scales (magnitudes differ between layers; one scale for all would drown the small ones).
    ``worker_error`` (``padded_size(tensor.numel(), n)`` elements) and ``server_error`` (1/n of
    that) are this rank's error-feedback buffers, updated in place; make them with
    :func:`error_buffers` and keep them across calls. Collective: every rank of ``group`` calls it
    with a tensor of the same size. Returns ``tensor``. On a group of one rank it does nothing.
    """
    n = dist.get_world_size(group) if dist.is_initialized() else 1
    numel = tensor.numel()
    if n == 1 or numel == 0:
        return tensor
    padded = padded_size(numel, n)
    if worker_error.numel() != padded or server_error.numel() != padded // n:
        raise ValueError(
            f"compressed_all_reduce: error buffers of {worker_error.numel()} and {server_error.numel()} elements "
            f"do not fit a {numel}-element tensor on {n} ranks (expected {padded} and {padded // n}); "
            "make them with shardwise.comm.compressed.error_buffers"
        )
    me = dist.get_rank(group)
    lay = _layout(numel, n, tuple(sizes or (numel,)))
    chunk, segs = lay.chunk, lay.per_chunk

    # 1. worker: compensate, compress one chunk per destination, all-to-all
    worker_error[:numel].add_(tensor.detach().reshape(-1))  # compensated, then overwritten by the new error
    rows = worker_error.view(n, chunk)
    send = _compress(rows, lay.segments, segs, rows)
    recv = torch.empty_like(send)
    _all_to_all(recv, send, group)

    # 2. server: average my chunk over the ranks, compensate, compress, all-gather
    mine_segments = lay.segments[me]
    mine = _decompress(recv, [mine_segments] * n, segs).sum(dim=0).div_(n)  # rank order: deterministic
    for a, b, real in mine_segments:
        mine[a + real : b] = 0.0  # padding: nothing to send, nothing to remember
    mine.add_(server_error)
    reply = _compress(mine.view(1, chunk), [mine_segments], segs, server_error.view(1, chunk))
    gathered = torch.empty(n * reply.shape[1], dtype=torch.uint8, device=tensor.device)
    _all_gather(gathered, reply.view(-1), group)

    result = _decompress(gathered.view(n, -1), lay.segments, segs).view(-1)[:numel]
    with torch.no_grad():
        tensor.copy_(result.view(tensor.shape))
    return tensor


def check_backend(name: str | None, group=None) -> str:
    """Validate DeepSpeed's ``comm_backend_name`` against the process group; return the backend used.

    The compressed all-reduce runs over the data-parallel process group's own collectives, so
    ``gloo`` and ``nccl`` must name that group's backend; DeepSpeed's ``compressed`` (its packbits
    kernel over any backend) maps to whatever the group runs; ``mpi`` / ``hccl`` are accepted only
    when the group really is MPI / HCCL. ``None`` means the group's backend.
    """
    where = "comm_backend_name"
    actual = dist.get_backend(group) if dist.is_initialized() else None
    if name is None or actual is None:
        return str(actual or name or "none")
    if not isinstance(name, str):
        raise ValueError(f"{where}: must be a string, got {name!r}")
    key = name.lower()
    if key == "compressed":
        return actual
    if key in ("gloo", "nccl", "mpi", "hccl"):
        if key == actual:
            return actual
        extra = ""
        if key == "mpi":
            extra = (" (DeepSpeed's 'mpi' backend is mpi4py with CUDA-aware MPI; shardwise sends the packed "
                     "signs over the process group instead)")
        raise ValueError(
            f"{where}: {name!r}, but the data-parallel process group runs {actual!r}{extra}; the compressed "
            f"all-reduce uses the process group's collectives: set it to {actual!r} or 'compressed', or remove it"
        )
    raise ValueError(f"{where}: unknown backend {name!r}; use 'gloo', 'nccl', 'mpi', 'hccl' or 'compressed' "
                     f"(the data-parallel group runs {actual!r})")

