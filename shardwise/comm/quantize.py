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
    return _unpack(values.view(scales.shape[0], -1), bits) * scales[:, None]


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
    q = torch.round(scaled).clamp_(lo, hi).to(torch.int8)
    if bits == 8:
        return q.view(torch.uint8)
    u = (q.to(torch.int16) & 0xF).to(torch.uint8)
    return u[..., 0::2] | (u[..., 1::2] << 4)


def _unpack(values: torch.Tensor, bits: int) -> torch.Tensor:
    """The codes of ``values`` as float32 (the last dimension doubles for 4 bits)."""
    if bits == 8:
        return values.view(torch.int8).float()
    lo = (values & 0xF).to(torch.int16)
    hi = (values >> 4).to(torch.int16)
    q = torch.stack((lo, hi), dim=-1).flatten(-2)
    return torch.where(q >= 8, q - 16, q).float()


def quantize_rows(x: torch.Tensor, block_of: torch.Tensor, nblocks: int,
                  bits: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values, scales)`` of the rows of ``x`` (``[R, Q]``), each row cut into the same ``nblocks`` blocks:
    element ``j`` belongs to block ``block_of[j]`` (int64, ``[Q]``). The codes and scales are those of
    ``quantize`` (a block of ``block`` elements gives the same codes either way). ``values``: uint8 ``[R, Q]``
    (int8) or ``[R, Q / 2]`` (int4, ``Q`` even); ``scales``: fp32 ``[R, nblocks]``."""
    if bits not in (4, 8):
        raise ValueError(f"quantize_rows: bits must be 4 or 8, got {bits}")
    if bits == 4 and x.shape[-1] % 2:
        raise ValueError(f"quantize_rows: int4 packs two values a byte; rows of {x.shape[-1]} elements are odd")
    return kernels(f"quantize_rows{bits}", _quantize_rows, x.detach(), block_of, nblocks, bits)


def _quantize_rows(x: torch.Tensor, block_of: torch.Tensor, nblocks: int, bits: int):
    x = x.float()
    index = block_of.expand(x.shape[0], -1)
    absmax = x.new_zeros(x.shape[0], nblocks).scatter_reduce_(1, index, x.abs(), "amax")
    scales = absmax * (2.0 / (1 << bits))
    inv = torch.where(scales > 0, 1.0 / scales, torch.zeros_like(scales))
    return _codes(x * inv.gather(1, index), bits), scales


def dequantize_rows(values: torch.Tensor, scales: torch.Tensor, block_of: torch.Tensor,
                    bits: int = 4) -> torch.Tensor:
    """The fp32 rows ``quantize_rows`` encoded."""
    return kernels(f"dequantize_rows{bits}", _dequantize_rows, values, scales, block_of, bits)


def _dequantize_rows(values: torch.Tensor, scales: torch.Tensor, block_of: torch.Tensor, bits: int):
    return _unpack(values, bits) * scales.gather(1, block_of.expand(scales.shape[0], -1))


def dequantize(values: torch.Tensor, scales: torch.Tensor, block: int, bits: int = 8, *,
               dtype: torch.dtype = torch.float32, out: torch.Tensor | None = None) -> torch.Tensor:
    """The flat tensor ``quantize`` encoded (in ``dtype``, or written into ``out``)."""
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
