"""Block-sparse attention layouts: DeepSpeed's ``deepspeed.ops.sparse_attention.sparsity_config``.

A layout is an int64 tensor ``[num_heads, num_blocks, num_blocks]``: entry ``[h, i, j]`` is 1 when
the queries of block ``i`` attend to the keys of block ``j`` in head ``h`` (``num_blocks =
seq_len / block``).  The classes take DeepSpeed's constructor arguments and ``make_layout(seq_len)``
builds the same layouts (the random blocks of ``Variable``/``BigBird`` come from Python's
``random`` module, as in DeepSpeed, so ``random.seed`` fixes them).  Unless
``different_layout_per_head``, head 0's layout is copied to every head.
"""

from __future__ import annotations

import random

import torch

__all__ = ["SparsityConfig", "DenseSparsityConfig", "FixedSparsityConfig", "VariableSparsityConfig",
           "BigBirdSparsityConfig", "BSLongformerSparsityConfig", "LocalSlidingWindowSparsityConfig",
           "sparsity_config_from_dict"]

_DIRECTIONS = ("unidirectional", "bidirectional")


def _check_attention(attention: str) -> None:
    if attention not in _DIRECTIONS:
        raise NotImplementedError(f"attention={attention!r}: only 'unidirectional' and 'bidirectional' are supported")


def _check_global_ranges(starts, ends) -> None:
    if ends is None:
        return
    if len(starts) != len(ends):
        raise ValueError(f"global_block_indices has {len(starts)} entries but global_block_end_indices has "
                         f"{len(ends)}: they must have the same length")
    for s, e in zip(starts, ends):
        if s >= e:
            raise ValueError(f"global block start index {s} must be smaller than its end index {e}")


def _global_ranges(starts, ends, num_blocks: int) -> list[tuple[int, int]]:
    """(start, end) block ranges of the global blocks that fall inside the sequence."""
    if ends is None:
        return [(s, s + 1) for s in starts if s < num_blocks]
    return [(s, min(e, num_blocks)) for s, e in zip(starts, ends) if s < num_blocks]


def _window(layout: torch.Tensor, h: int, start: int, end: int, causal: bool) -> None:
    """Blocks ``start..end-1`` attend to each other (to themselves and earlier ones if ``causal``)."""
    n = end - start
    if n <= 0:
        return
    block = torch.ones(n, n, dtype=layout.dtype)
    layout[h, start:end, start:end] = torch.tril(block) if causal else block


def _sliding(layout: torch.Tensor, h: int, width: int, causal: bool) -> None:
    """Row ``i`` attends to blocks ``i - width//2 .. i + width//2`` (up to ``i`` if ``causal``)."""
    num_blocks = layout.shape[1]
    if num_blocks < width:
        raise ValueError(f"num_sliding_window_blocks={width} must not exceed the number of blocks in a row "
                         f"({num_blocks})")
    half = width // 2
    for row in range(num_blocks):
        layout[h, row, max(0, row - half):(row + 1 if causal else min(num_blocks, row + half + 1))] = 1


def _random_blocks(layout, h, k, causal):
    """``k`` random blocks in each row of head ``h`` (among the row's earlier blocks if ``causal``)."""
    n = layout.shape[1]
    if n < k:
        raise ValueError(f"num_random_blocks={k} must not exceed the number of blocks in a row ({n})")
    for row in range(n):
        layout[h, row, random.sample(range(row + 1) if causal else range(n), k)] = 1
    return layout


class SparsityConfig:
    """What every layout shares: ``num_heads``, ``block`` (the block edge in tokens) and
    ``different_layout_per_head``."""

    def __init__(self, num_heads, block=16, different_layout_per_head=False):
        self.num_heads = num_heads
        self.block = block
        self.different_layout_per_head = different_layout_per_head
        self.num_layout_heads = num_heads if different_layout_per_head else 1

    def setup_layout(self, seq_len):
        """An all-zero layout for ``seq_len`` tokens (which must be a multiple of ``block``)."""
        if seq_len % self.block != 0:
            raise ValueError(f"Sequence Length, {seq_len}, needs to be dividable by Block size {self.block}!")
        n = seq_len // self.block
        return torch.zeros((self.num_heads, n, n), dtype=torch.int64)

    def check_and_propagate_first_head_layout(self, layout):
        """Copy head 0's layout to every head unless each head has its own."""
        if not self.different_layout_per_head:
            layout[1:] = layout[0]
        return layout

    def make_layout(self, seq_len):
        raise NotImplementedError(f"{type(self).__name__} does not define make_layout")


class DenseSparsityConfig(SparsityConfig):
    """Every block attends to every block (a reference point, not sparse)."""

    def __init__(self, num_heads, block=16, different_layout_per_head=False):
        super().__init__(num_heads, block, different_layout_per_head)

    def make_layout(self, seq_len):
        layout = self.setup_layout(seq_len)
        layout[:] = 1
        return layout


class FixedSparsityConfig(SparsityConfig):
    """"Fixed" pattern of Sparse Transformers (Child et al. 2019), as DeepSpeed customised it.

    Local: the sequence is cut into windows of ``num_local_blocks`` blocks that attend within
    themselves (causally if ``attention='unidirectional'``).  Global: in every full window the
    ``num_global_blocks`` blocks ending ``(1 + h % num_different_global_patterns) *
    num_global_blocks`` blocks before the window's end are attended by every (later, if
    unidirectional) row; ``horizontal_global_attention`` (bidirectional only) also lets them
    attend to everything.  A short last window gets global blocks at the same offset, moved
    left so they fit.
    """

    def __init__(self, num_heads, block=16, different_layout_per_head=False, num_local_blocks=4, num_global_blocks=1,
                 attention="bidirectional", horizontal_global_attention=False, num_different_global_patterns=1):
        super().__init__(num_heads, block, different_layout_per_head)
        if num_local_blocks % num_global_blocks != 0:
            raise ValueError(f"Number of blocks in a local window, {num_local_blocks}, must be dividable by number "
                             f"of global blocks, {num_global_blocks}!")
        _check_attention(attention)
        if attention != "bidirectional" and horizontal_global_attention:
            raise ValueError("only bidirectional attention can have horizontal_global_attention")
        if num_different_global_patterns > 1 and not different_layout_per_head:
            raise ValueError("num_different_global_patterns > 1 needs different_layout_per_head=True (a single "
                             "layout is shared by every head)")
        if num_different_global_patterns > num_local_blocks // num_global_blocks:
            raise ValueError(f"num_different_global_patterns={num_different_global_patterns} cannot exceed "
                             f"num_local_blocks / num_global_blocks = {num_local_blocks // num_global_blocks}")
        self.num_local_blocks = num_local_blocks
        self.num_global_blocks = num_global_blocks
        self.attention = attention
        self.horizontal_global_attention = horizontal_global_attention
        self.num_different_global_patterns = num_different_global_patterns

    def set_local_layout(self, h, layout):
        n = layout.shape[1]
        for start in range(0, n, self.num_local_blocks):
            _window(layout, h, start, min(start + self.num_local_blocks, n), self.attention == "unidirectional")
        return layout

    def _global_columns(self, h, layout, start, end):
        first_row = 0 if self.attention == "bidirectional" else start
        layout[h, first_row:, start:end] = 1
        if self.horizontal_global_attention:
            layout[h, start:end, :] = 1

    def set_global_layout(self, h, layout):
        n = layout.shape[1]
        g = self.num_global_blocks
        offset = self.num_local_blocks - (1 + h % self.num_different_global_patterns) * g
        full_windows_end = n - n % self.num_local_blocks
        for start in range(offset, full_windows_end, self.num_local_blocks):
            self._global_columns(h, layout, start, start + g)
        if full_windows_end < n:  # a short last window
            start = min(full_windows_end + offset, n - g)
            self._global_columns(h, layout, start, start + g)
        return layout

    def make_layout(self, seq_len):
        layout = self.setup_layout(seq_len)
        for h in range(self.num_layout_heads):
            self.set_local_layout(h, layout)
            self.set_global_layout(h, layout)
        return self.check_and_propagate_first_head_layout(layout)


class VariableSparsityConfig(SparsityConfig):
    """``Fixed`` generalised: ``num_random_blocks`` random blocks per row, local windows of the sizes
    in ``local_window_blocks`` (the last size repeats to the end), global blocks at
    ``global_block_indices`` (or the ranges ``[global_block_indices[i], global_block_end_indices[i])``)
    attended by every (later, if unidirectional) row, and attending to everything with
    ``horizontal_global_attention``."""

    def __init__(self, num_heads, block=16, different_layout_per_head=False, num_random_blocks=0,
                 local_window_blocks=[4], global_block_indices=[0], global_block_end_indices=None,
                 attention="bidirectional", horizontal_global_attention=False):
        super().__init__(num_heads, block, different_layout_per_head)
        _check_global_ranges(global_block_indices, global_block_end_indices)
        _check_attention(attention)
        if attention != "bidirectional" and horizontal_global_attention:
            raise ValueError("only bidirectional attention can have horizontal_global_attention")
        self.num_random_blocks = num_random_blocks
        self.local_window_blocks = local_window_blocks
        self.global_block_indices = global_block_indices
        self.global_block_end_indices = global_block_end_indices
        self.attention = attention
        self.horizontal_global_attention = horizontal_global_attention

    def set_random_layout(self, h, layout):
        return _random_blocks(layout, h, self.num_random_blocks, causal=False)

    def set_local_layout(self, h, layout):
        n = layout.shape[1]
        causal = self.attention == "unidirectional"
        start = 0
        for size in self.local_window_blocks:
            _window(layout, h, start, min(start + size, n), causal)
            start += size
        size = self.local_window_blocks[-1]
        for s in range(start, n, size):  # the last window size repeats to the end
            _window(layout, h, s, min(s + size, n), causal)
        return layout

    def set_global_layout(self, h, layout):
        n = layout.shape[1]
        for start, end in _global_ranges(self.global_block_indices, self.global_block_end_indices, n):
            if self.horizontal_global_attention:
                layout[h, start:end, :] = 1
            layout[h, (0 if self.attention == "bidirectional" else start):, start:end] = 1
        return layout

    def make_layout(self, seq_len):
        layout = self.setup_layout(seq_len)
        for h in range(self.num_layout_heads):
            self.set_random_layout(h, layout)
            self.set_local_layout(h, layout)
            self.set_global_layout(h, layout)
        return self.check_and_propagate_first_head_layout(layout)


class BigBirdSparsityConfig(SparsityConfig):
    """BigBird (Zaheer et al. 2020): ``num_random_blocks`` random blocks per row (among earlier ones
    if unidirectional), a sliding window of ``num_sliding_window_blocks`` blocks centred on the
    diagonal, and the first ``num_global_blocks`` blocks attending to and attended by everything;
    unidirectional keeps only the lower triangle."""

    def __init__(self, num_heads, block=16, different_layout_per_head=False, num_random_blocks=1,
                 num_sliding_window_blocks=3, num_global_blocks=1, attention="bidirectional"):
        super().__init__(num_heads, block, different_layout_per_head)
        _check_attention(attention)
        self.num_random_blocks = num_random_blocks
        self.num_sliding_window_blocks = num_sliding_window_blocks
        self.num_global_blocks = num_global_blocks
        self.attention = attention

    def set_random_layout(self, h, layout):
        return _random_blocks(layout, h, self.num_random_blocks, causal=self.attention != "bidirectional")

    def set_sliding_window_layout(self, h, layout):
        _sliding(layout, h, self.num_sliding_window_blocks, causal=False)
        return layout

    def set_global_layout_itc(self, h, layout):
        n = layout.shape[1]
        if n < self.num_global_blocks:
            raise ValueError(f"num_global_blocks={self.num_global_blocks} must not exceed the number of blocks in a "
                             f"row ({n})")
        layout[h, :self.num_global_blocks, :] = 1
        layout[h, :, :self.num_global_blocks] = 1
        if self.attention == "unidirectional":
            layout = torch.tril(layout)  # (every head, as DeepSpeed does)
        return layout

    def make_layout(self, seq_len):
        layout = self.setup_layout(seq_len)
        for h in range(self.num_layout_heads):
            self.set_random_layout(h, layout)
            self.set_sliding_window_layout(h, layout)
            layout = self.set_global_layout_itc(h, layout)
        return self.check_and_propagate_first_head_layout(layout)


class BSLongformerSparsityConfig(SparsityConfig):
    """Block-sparse Longformer (Beltagy et al. 2020): a sliding window of
    ``num_sliding_window_blocks`` blocks and global blocks (``global_block_indices``, or ranges up
    to ``global_block_end_indices``) attending to and attended by everything; unidirectional
    keeps only the lower triangle."""

    def __init__(self, num_heads, block=16, different_layout_per_head=False, num_sliding_window_blocks=3,
                 global_block_indices=[0], global_block_end_indices=None, attention="bidirectional"):
        super().__init__(num_heads, block, different_layout_per_head)
        _check_global_ranges(global_block_indices, global_block_end_indices)
        self.num_sliding_window_blocks = num_sliding_window_blocks
        self.global_block_indices = global_block_indices
        self.global_block_end_indices = global_block_end_indices
        self.attention = attention

    def set_sliding_window_layout(self, h, layout):
        _sliding(layout, h, self.num_sliding_window_blocks, causal=False)
        return layout

    def set_global_layout(self, h, layout):
        n = layout.shape[1]
        for start, end in _global_ranges(self.global_block_indices, self.global_block_end_indices, n):
            layout[h, start:end, :] = 1
            layout[h, :, start:end] = 1
        if self.attention == "unidirectional":
            layout = torch.tril(layout)
        return layout

    def make_layout(self, seq_len):
        layout = self.setup_layout(seq_len)
        for h in range(self.num_layout_heads):
            self.set_sliding_window_layout(h, layout)
            layout = self.set_global_layout(h, layout)
        return self.check_and_propagate_first_head_layout(layout)


class LocalSlidingWindowSparsityConfig(SparsityConfig):
    """A purely local sliding window of ``num_sliding_window_blocks`` blocks (the current block and
    ``num_sliding_window_blocks // 2`` before it if unidirectional, the default; as many on each
    side if bidirectional)."""

    def __init__(self, num_heads, block=16, num_sliding_window_blocks=3, attention="unidirectional"):
        super().__init__(num_heads, block)
        self.num_sliding_window_blocks = num_sliding_window_blocks
        self.attention = attention

    def set_sliding_window_layout(self, h, layout):
        _sliding(layout, h, self.num_sliding_window_blocks, causal=self.attention != "bidirectional")
        return layout

    def make_layout(self, seq_len):
        layout = self.setup_layout(seq_len)
        for h in range(self.num_layout_heads):
            self.set_sliding_window_layout(h, layout)
        return self.check_and_propagate_first_head_layout(layout)


# -- the DeepSpeed config's "sparse_attention" block -----------------------------------------
_MODES = {  # mode -> (class, the keys DeepSpeed read for it besides "mode")
    "dense": (DenseSparsityConfig, ("block",)),
    "fixed": (FixedSparsityConfig, ("block", "different_layout_per_head", "num_local_blocks", "num_global_blocks",
                                    "attention", "horizontal_global_attention", "num_different_global_patterns")),
    "variable": (VariableSparsityConfig, ("block", "different_layout_per_head", "num_random_blocks",
                                          "local_window_blocks", "global_block_indices", "global_block_end_indices",
                                          "attention", "horizontal_global_attention")),
    "bigbird": (BigBirdSparsityConfig, ("block", "different_layout_per_head", "num_random_blocks",
                                        "num_sliding_window_blocks", "num_global_blocks")),
    "bslongformer": (BSLongformerSparsityConfig, ("block", "different_layout_per_head", "num_sliding_window_blocks",
                                                  "global_block_indices", "global_block_end_indices")),
}


def sparsity_config_from_dict(block: dict, num_heads: int) -> SparsityConfig:
    """The ``SparsityConfig`` a DeepSpeed config's ``"sparse_attention"`` block describes (``mode``:
    dense, fixed (the default), variable, bigbird or bslongformer, plus that class's arguments)."""
    block = dict(block)
    mode = block.pop("mode", "fixed")
    if mode not in _MODES:
        raise ValueError(f"sparse_attention.mode = {mode!r} is not one of {', '.join(_MODES)}")
    cls, keys = _MODES[mode]
    unknown = sorted(set(block) - set(keys))
    if unknown:
        raise ValueError(f"sparse_attention.{unknown[0]} is not a setting of mode {mode!r} (its settings: "
                         f"{', '.join(keys)})")
    return cls(num_heads=num_heads, **block)
