"""1-bit compressed all-reduce with error feedback (the exchange of 1-bit Adam, 0/1 Adam, 1-bit LAMB).

Every rank holds a flat fp32 buffer (its momentum, say) and wants the average over the group.
Instead of 32 bits per element, each element travels as one sign bit, twice:

1. **worker side**: add this rank's *worker error* (what compression lost last time) to the
   buffer, cut it into one chunk per rank, and replace each chunk by ``scale * sign``, where
   ``scale`` is the chunk's root mean square (so the chunk keeps its L2 norm). What that loses
   becomes the new worker error. The signs are packed 8 per byte, each chunk followed by its
   scale (4 bytes); an **all-to-all** sends chunk j to rank j.
2. **server side**: rank j unpacks the n versions of its chunk, averages ``scale_i * sign_i``,
   adds its *server error*, compresses the result the same way (one scale for the chunk), keeps
   the loss as the new server error, and an **all-gather** of the packed chunks gives every
   rank the whole averaged buffer.

Error feedback makes the compression unbiased over time: with errors starting at zero, the
sum of the outputs over T calls equals the sum of the true averages minus (the mean of the
ranks' worker errors + the server error) after call T, elementwise, so nothing is lost, only
delayed (``tests/test_onebit_comm.py`` checks that identity and that the errors stay bounded).

Per element, each rank sends (n-1)/n bits in each phase instead of the 2(n-1)/n x 32 bits of a
ring all-reduce: 32x less, plus 4 bytes per chunk for the scales. DeepSpeed does the same in
``runtime/comm/{nccl,compressed}.py`` with one scale per worker tensor and cupy / a CUDA kernel
for the bit packing; here the packing is plain torch bit arithmetic, so one code path serves gloo
(CPU) and NCCL (GPU). Sign 0 counts as positive, as in DeepSpeed.

Both collectives go through ``ops.run`` under their own names (``compressed_all_to_all``,
``compressed_all_gather``), so the comms logger shows them with the bytes actually sent.
"""

from __future__ import annotations

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


def message_bytes(numel: int, world_size: int) -> int:
    """Bytes of each of the two messages (all-to-all input, all-gather output) for ``numel`` elements."""
    chunk = padded_size(numel, world_size) // world_size
    return world_size * (chunk // 8 + _SCALE_BYTES)


_WEIGHTS: dict[torch.device, torch.Tensor] = {}


def _bit_weights(device) -> torch.Tensor:
    w = _WEIGHTS.get(device)
    if w is None:
        w = _WEIGHTS[device] = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8, device=device)
    return w


def pack_signs(positive: torch.Tensor) -> torch.Tensor:
    """Pack a boolean tensor (last dimension a multiple of 8) into bytes, most significant bit first
    (``numpy.packbits`` order): ``[..., k]`` -> ``[..., k // 8]`` uint8."""
    if positive.shape[-1] % 8:
        raise ValueError(f"pack_signs: last dimension {positive.shape[-1]} is not a multiple of 8")
    bits = positive.reshape(*positive.shape[:-1], -1, 8).to(torch.uint8)
    return (bits * _bit_weights(positive.device)).sum(dim=-1, dtype=torch.uint8)


def unpack_signs(packed: torch.Tensor) -> torch.Tensor:
    """``[..., m]`` uint8 -> ``[..., 8m]`` float32 of +1 (bit set) / -1."""
    bits = torch.bitwise_and(packed.unsqueeze(-1), _bit_weights(packed.device)) != 0
    return (bits.to(torch.float32) * 2 - 1).reshape(*packed.shape[:-1], -1)


def _rms(rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Root mean square of each row over its first ``counts[i]`` (real, unpadded) elements."""
    return rows.norm(dim=-1) / counts.clamp(min=1).sqrt()


def _compress(rows: torch.Tensor, counts: torch.Tensor, error: torch.Tensor) -> torch.Tensor:
    """Rows -> packed signs and scales ``[rows, chunk/8 + 4]`` uint8; ``error`` (same shape as
    ``rows``) becomes what was lost. Padded positions (beyond ``counts``) carry no error."""
    scales = _rms(rows, counts).to(torch.float32)
    positive = rows >= 0
    torch.sub(rows, torch.where(positive, scales[:, None], -scales[:, None]), out=error)
    cols = torch.arange(rows.shape[-1], device=rows.device)
    error.masked_fill_(cols[None, :] >= counts[:, None], 0.0)
    packed = pack_signs(positive)
    return torch.cat([packed, scales.contiguous().view(torch.uint8).view(rows.shape[0], _SCALE_BYTES)], dim=1)


def _decompress(message: torch.Tensor) -> torch.Tensor:
    """``[rows, chunk/8 + 4]`` uint8 -> ``[rows, chunk]`` float32 of ``scale * sign``."""
    scales = message[:, -_SCALE_BYTES:].contiguous().view(torch.float32)  # [rows, 1]
    return unpack_signs(message[:, :-_SCALE_BYTES]).mul_(scales)


def _all_to_all(output: torch.Tensor, tensor: torch.Tensor, group) -> None:
    ops.run("compressed_all_to_all", lambda: dist.all_to_all_single(output, tensor, group=group),
            group=group, tensors=(tensor,), nbytes=tensor.numel() * tensor.element_size())


def _all_gather(output: torch.Tensor, tensor: torch.Tensor, group) -> None:
    impl = direct.all_gather if direct.enabled(group, output, tensor) else dist.all_gather_into_tensor
    ops.run("compressed_all_gather", lambda: impl(output, tensor, group=group),
            group=group, tensors=(tensor,), nbytes=output.numel() * output.element_size())


def compressed_all_reduce(tensor: torch.Tensor, worker_error: torch.Tensor, server_error: torch.Tensor,
                          group=None) -> torch.Tensor:
    """Replace ``tensor`` (any shape, floating point) by the 1-bit compressed average over ``group``.

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
    chunk = padded // n
    device = tensor.device
    starts = torch.arange(n, device=device) * chunk
    counts = (numel - starts).clamp(min=0, max=chunk)  # real elements in each chunk

    # 1. worker: compensate, compress one chunk per destination, all-to-all
    compensated = worker_error.clone()
    compensated[:numel].add_(tensor.detach().reshape(-1).to(torch.float32))
    send = _compress(compensated.view(n, chunk), counts, worker_error.view(n, chunk))
    recv = torch.empty_like(send)
    _all_to_all(recv, send, group)

    # 2. server: average my chunk over the ranks, compensate, compress, all-gather
    mine = _decompress(recv).sum(dim=0).div_(n)  # rank order: the same sum whatever the arrival order
    mine[int(counts[me]):] = 0.0  # padding: nothing to send, nothing to remember
    mine.add_(server_error)
    reply = _compress(mine.view(1, chunk), counts[me : me + 1], server_error.view(1, chunk))
    gathered = torch.empty(n * reply.shape[1], dtype=torch.uint8, device=device)
    _all_gather(gathered, reply.view(-1), group)

    result = _decompress(gathered.view(n, -1)).view(-1)[:numel]
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

