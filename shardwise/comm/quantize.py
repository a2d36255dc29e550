"""Blockwise symmetric quantization of flat tensors (ZeRO++'s qwZ and qgZ).

A flat tensor of ``n`` elements is cut into blocks of ``block`` consecutive elements (``n`` must be a
multiple of ``block``; callers pad). Each block gets one fp32 scale ``s = 2 * absmax / 2**bits`` (zero for
an all-zero block) and each element the integer ``clamp(round(x / s), -2**(bits-1), 2**(bits-1) - 1)``:
DeepSpeed's symmetric quantizer (``csrc/includes/quantization_utils.h``: its kernel multiplies by
``2**bits / (2 * absmax)`` and stores the inverse as the block's scale). Dequantizing is ``q * s``. An
element's error is at most ``s / 2``, except the block's largest positive value, which the clamp may cut
by up to ``s`` (values above ``(2**(bits-1) - 1/2) * s``; ``s`` is ``absmax / 128`` for int8, ``absmax / 8`` for int4).

int8 values are one byte each; int4 values are packed two to a byte (element ``2i`` in the low nibble,
``2i + 1`` in the high one), so ``block`` must be even for 4 bits.

``quantize_rows`` / ``dequantize_rows`` do the same to the rows of a 2-D tensor whose blocks are given per
element (runs of consecutive elements, of any lengths): qgZ's gradient rows, where each parameter's piece
has its own block size.

Block sizes: ``weight_block_size(n)`` is the group layout DeepSpeed's ``CUDAQuantizer`` picks for the
parameter all-gather (``runtime/zero/partition_parameters.py``): about ``n / 8000`` groups, grown until
``n`` divides into groups of a multiple of 8 elements, then halved in size while they stay above 8000
elements. Where ``n`` has no such layout (DeepSpeed asserts) the shard is padded to whole blocks of
``FALLBACK_BLOCK`` elements instead.
"""

from __future__ import annotations

import logging
import math
import os

import torch

logger = logging.getLogger(__name__)

TARGET_GROUP_SIZE = 8000  # DeepSpeed's CUDAQuantizer.target_group_size
FALLBACK_BLOCK = 4096  # elements per block where DeepSpeed's layout has none for a size
MIN_BLOCK = 64  # a layout with smaller groups than this is not worth its scales: fall back


def deepspeed_groups(numel: int, target: int = TARGET_GROUP_SIZE) -> int | None:
    """The number of quantization groups DeepSpeed's ``CUDAQuantizer.quantize`` uses for ``numel``
    elements, or None where it has none (``numel`` not a multiple of 8)."""
    if numel <= 0 or numel % 8:
        return None
    groups = math.ceil(numel / target)
    while groups < numel:
        if numel % (8 * groups) == 0:
            break
        groups += 1
    while numel % (8 * groups * 2) == 0 and numel / groups > target:
        groups *= 2
    if numel % (8 * groups) or numel <= groups:
        return None
    return groups


def weight_block_size(numel: int) -> int:
    """Elements per block for an all-gathered shard of ``numel`` elements (see the module docstring)."""
    groups = deepspeed_groups(numel)
    if groups is not None and numel // groups >= MIN_BLOCK:
        return numel // groups
    return min(FALLBACK_BLOCK, _even(max(numel, 2)))


def _even(n: int) -> int:
    return n + (n & 1)


def padded_numel(numel: int, block: int) -> int:
    return -(-numel // block) * block


def packed_numel(numel: int, bits: int) -> int:
    """Bytes that ``numel`` quantized values take."""
    return numel // 2 if bits == 4 else numel


def _quantize_blocks(blocks: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``blocks`` [n_blocks, block] (any float dtype) -> (uint8 values, fp32 scales)."""
    blocks = blocks.float()
    scales = blocks.abs().amax(dim=1) * (2.0 / (1 << bits))
    inv = torch.where(scales > 0, 1.0 / scales, torch.zeros_like(scales))
    return _codes(blocks * inv[:, None], bits).reshape(-1), scales


def _dequantize_blocks(values: torch.Tensor, scales: torch.Tensor, bits: int) -> torch.Tensor:
    """fp32 [n_blocks, block] of what ``_quantize_blocks`` encoded."""
    return _scaled_codes(values.view(scales.shape[0], -1), scales[:, None], bits)


class _Kernels:
    """The quantizer's functions, compiled with ``torch.compile`` on first use of each size where that works
    (each is then one pass over memory instead of several), else the same functions run eagerly. Compiled and
    eager give the same bits (tests/test_quantize_compiled.py). ``SHARDWISE_ZEROPP_COMPILE=0`` keeps them eager (no
    compile time, e.g. for short runs or where no C++ compiler / Triton is installed)."""

    def __init__(self) -> None:
        self.compiled: dict[str, object] = {}
        self.failed: str | None = None

    def enabled(self) -> bool:
        return self.failed is None and os.environ.get("SHARDWISE_ZEROPP_COMPILE", "1") not in ("0", "false", "False")

    def __call__(self, name: str, fn, *args):
        if not self.enabled() or torch.compiler.is_compiling():
            return fn(*args)
        compiled = self.compiled.get(name)
        if compiled is None:
            # static shapes: each distinct size compiles once (a model's repeated layers share sizes); with
            # symbolic sizes the compiled index arithmetic made dequantizing slower than eager on CPU
            compiled = self.compiled[name] = torch.compile(fn, dynamic=False)
        try:
            return compiled(*args)
        except Exception as exc:  # no compiler on this machine, an unsupported device, ...: run eagerly
            self.failed = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            logger.warning("ZeRO++ quantizer: torch.compile failed (%s); running it eagerly", self.failed)
            return fn(*args)


kernels = _Kernels()


def quantize(x: torch.Tensor, block: int, bits: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values, scales)`` of the flat tensor ``x`` (``x.numel() % block == 0``): ``values`` uint8 (int8 bit
    patterns, or two int4 per byte), ``scales`` fp32, one per block."""
    if bits not in (4, 8):
        raise ValueError(f"quantize: bits must be 4 or 8, got {bits}")
    n = x.numel()
    if n % block or (bits == 4 and block % 2):
        raise ValueError(f"quantize: {n} elements do not cut into blocks of {block}"
                         + (" (int4 needs an even block)" if bits == 4 else ""))
    return kernels(f"quantize{bits}", _quantize_blocks, x.detach().reshape(-1, block), bits)


def _codes(scaled: torch.Tensor, bits: int) -> torch.Tensor:
    """Round and clamp ``scaled`` (values over their block's scale) to ``bits``-bit codes, packed as uint8
    along the last dimension (its length must be even for 4 bits)."""
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    q = torch.round(scaled).clamp_(lo, hi)
    if bits == 8:
        return q.to(torch.int8).view(torch.uint8)
    pairs = q.to(torch.int32).view(*q.shape[:-1], -1, 2)  # (32-bit lanes: the compiled loop stays vectorized)
    return ((pairs[..., 0] & 0xF) | ((pairs[..., 1] & 0xF) << 4)).to(torch.uint8)


def _scaled_codes(values: torch.Tensor, step: torch.Tensor, bits: int) -> torch.Tensor:
    """``codes * step`` in fp32: ``values`` holds the codes (int8, or uint8 with two int4 a byte, which doubles
    the last dimension), ``step`` broadcasts against ``values`` (for int4, each byte's two codes share it)."""
    if bits == 8:
        return (values if values.dtype == torch.int8 else values.view(torch.int8)).float() * step
    v = values.to(torch.int32)
    lo = ((v & 0xF) ^ 8) - 8  # the low nibble as a signed 4-bit integer
    hi = ((v >> 4) ^ 8) - 8
    return torch.stack((lo.float() * step, hi.float() * step), dim=-1).flatten(-2)


class RowBlocks:
    """The blocks of a row for ``quantize_rows``: runs of consecutive elements of any lengths, described by
    ``sub``, the greatest common divisor of the run lengths, and ``of_sub`` (int64, ``[Q / sub]``), the block
    of each run of ``sub`` elements. Every pass over the elements is then a pass over a ``[R, Q / sub, sub]``
    view (no per-element index); only the per-``sub`` maxima and scales go through ``of_sub``."""

    def __init__(self, sub: int, of_sub: torch.Tensor, nblocks: int) -> None:
        self.sub, self.of_sub, self.nblocks = int(sub), of_sub, int(nblocks)

    @classmethod
    def of(cls, block_of: torch.Tensor, nblocks: int | None = None) -> "RowBlocks":
        """From the block of every element (``[Q]``, runs of consecutive elements, numbered 0, 1, ...)."""
        block_of = block_of.reshape(-1).long()
        q = block_of.numel()
        if q == 0:
            return cls(1, block_of, int(nblocks or 0))
        starts = torch.nonzero(torch.diff(block_of, prepend=block_of[:1] - 1)).reshape(-1).tolist() + [q]
        sub = 0
        for a, b in zip(starts[:-1], starts[1:]):
            sub = math.gcd(sub, b - a)
        of_sub = block_of[::sub].contiguous()
        if not torch.equal(of_sub.repeat_interleave(sub), block_of):
            raise ValueError("quantize_rows: block_of must number runs of consecutive elements")
        return cls(sub, of_sub, int(of_sub.max()) + 1 if nblocks is None else nblocks)

    @classmethod
    def of_lengths(cls, lengths: list[int]) -> "RowBlocks":
        """From the lengths of the row's blocks, in order (no index per element is made)."""
        sub = 0
        for n in lengths:
            sub = math.gcd(sub, int(n))
        sub = sub or 1
        of_sub = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor([n // sub for n in lengths],
                                                                                  dtype=torch.long))
        return cls(sub, of_sub, len(lengths))

    def to(self, device) -> "RowBlocks":
        return RowBlocks(self.sub, self.of_sub.to(device), self.nblocks)


def _row_blocks(block_of, nblocks: int | None = None) -> RowBlocks:
    return block_of if isinstance(block_of, RowBlocks) else RowBlocks.of(block_of, nblocks)


def quantize_rows(x: torch.Tensor, block_of, nblocks: int, bits: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values, scales)`` of the rows of ``x`` (``[R, Q]``), each row cut into the same ``nblocks`` blocks:
    element ``j`` belongs to block ``block_of[j]`` (int64, ``[Q]``, or the ``RowBlocks`` made from it once). The
    codes and scales are those of ``quantize`` (a block of ``block`` elements gives the same codes either way).
    ``values``: uint8 ``[R, Q]`` (int8) or ``[R, Q / 2]`` (int4, ``Q`` even); ``scales``: fp32 ``[R, nblocks]``."""
    if bits not in (4, 8):
        raise ValueError(f"quantize_rows: bits must be 4 or 8, got {bits}")
    if bits == 4 and x.shape[-1] % 2:
        raise ValueError(f"quantize_rows: int4 packs two values a byte; rows of {x.shape[-1]} elements are odd")
    blocks = _row_blocks(block_of, nblocks)
    return kernels(f"quantize_rows{bits}", _quantize_rows, x.detach(), blocks.of_sub, blocks.nblocks, blocks.sub, bits)


def _quantize_rows(x: torch.Tensor, of_sub: torch.Tensor, nblocks: int, sub: int, bits: int):
    r = x.shape[0]
    xs = x.float().reshape(r, -1, sub)
    index = of_sub.expand(r, -1)
    absmax = xs.new_zeros(r, nblocks).scatter_reduce_(1, index, xs.abs().amax(dim=2), "amax")
    scales = absmax * (2.0 / (1 << bits))
    inv = torch.where(scales > 0, 1.0 / scales, torch.zeros_like(scales))
    return _codes((xs * inv.gather(1, index)[:, :, None]).view(r, -1), bits), scales


def dequantize_rows(values: torch.Tensor, scales: torch.Tensor, block_of, bits: int = 4) -> torch.Tensor:
    """The fp32 rows ``quantize_rows`` encoded."""
    blocks = _row_blocks(block_of, scales.shape[1])
    if bits == 8:
        values = values.view(torch.int8)  # (a view outside the compiled code: it then converts in vector lanes)
    return kernels(f"dequantize_rows{bits}", _dequantize_rows, values, scales, blocks.of_sub, blocks.sub, bits)


def dequantize_rows_sum(values: torch.Tensor, scales: torch.Tensor, block_of, bits: int, groups: int) -> torch.Tensor:
    """``dequantize_rows`` summed over ``groups`` consecutive sets of rows (row ``i`` of the result is the sum
    of rows ``i``, ``i + R / groups``, ...), in fp32, without the dequantized rows in memory."""
    blocks = _row_blocks(block_of, scales.shape[1])
    if bits == 8:
        values = values.view(torch.int8)
    return kernels(f"dequantize_rows_sum{bits}", _dequantize_rows_sum, values, scales, blocks.of_sub, blocks.sub,
                   bits, groups)


def _dequantize_rows_sum(values, scales, of_sub, sub: int, bits: int, groups: int):
    r = scales.shape[0]
    if bits == 4 and sub % 2:
        x = _dequantize_rows(values, scales, of_sub, sub, bits)
        return x.view(groups, r // groups, -1).sum(dim=0)
    step = scales.gather(1, of_sub.expand(r, -1)).view(groups, r // groups, -1, 1)
    v = values.view(groups, r // groups, -1, sub if bits == 8 else sub // 2)
    if bits == 8:
        return (v.float() * step).sum(dim=0).view(r // groups, -1)
    v = v.to(torch.int32)  # the two halves of each byte summed apart, then interleaved once
    lo = ((((v & 0xF) ^ 8) - 8).float() * step).sum(dim=0)
    hi = ((((v >> 4) ^ 8) - 8).float() * step).sum(dim=0)
    return torch.stack((lo, hi), dim=-1).view(r // groups, -1)


def _dequantize_rows(values: torch.Tensor, scales: torch.Tensor, of_sub: torch.Tensor, sub: int, bits: int):
    r = scales.shape[0]
    step = scales.gather(1, of_sub.expand(r, -1))  # [r, Q / sub]
    if bits == 4 and sub % 2:  # a byte's two codes may fall in two runs: a step per code
        return _scaled_codes(values, torch.ones((), dtype=torch.float32), bits) * step.repeat_interleave(sub, dim=1)
    per_value = sub if bits == 8 else sub // 2  # bytes per run
    return _scaled_codes(values.view(r, -1, per_value), step[:, :, None], bits).view(r, -1)


def dequantize_into(out: torch.Tensor, values: torch.Tensor, scales: torch.Tensor, block: int, bits: int = 8) -> None:
    """Write the rows ``quantize`` encoded into ``out`` (``[R, n]``): ``values`` and ``scales`` are ``R`` flat
    tensors of ``padded`` elements each, one after another (``padded >= n``, a multiple of ``block``); each row
    keeps its first ``n`` elements. One pass: no dequantized copy in between."""
    r, n = out.shape
    if r * n != scales.numel() * block:  # padded rows: dequantize, then keep each row's first n elements
        out.copy_(dequantize(values, scales, block, bits).view(r, -1)[:, :n])  # (compiled, that slice came out wrong)
        return
    if bits == 8:
        values = values.view(torch.int8)
    kernels(f"dequantize_into{bits}", _dequantize_into, out, values, scales, bits)


def _dequantize_into(out, values, scales, bits: int) -> None:
    out.copy_(_scaled_codes(values.view(scales.shape[0], -1), scales[:, None], bits).view(out.shape))


def dequantize(values: torch.Tensor, scales: torch.Tensor, block: int, bits: int = 8, *,
               dtype: torch.dtype = torch.float32, out: torch.Tensor | None = None) -> torch.Tensor:
    """The flat tensor ``quantize`` encoded (in ``dtype``, or written into ``out``)."""
    if bits == 8:
        values = values.view(torch.int8)  # (a view outside the compiled code: it then converts in vector lanes)
    x = kernels(f"dequantize{bits}", _dequantize_blocks, values, scales, bits).reshape(-1)
    if out is not None:
        out.copy_(x)
        return out
    return x.to(dtype)


def error_bound(x: torch.Tensor, block: int, bits: int = 8) -> torch.Tensor:
    """Per element, the largest error ``dequantize(quantize(x))`` may have (the block's scale)."""
    blocks = x.detach().reshape(-1, block).float()
    scales = blocks.abs().amax(dim=1) * (2.0 / (1 << bits))
    return scales.repeat_interleave(block)
