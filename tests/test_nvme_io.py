"""The NVMe store: any offset, length and buffer alignment round-trips, concurrent requests on
adjacent regions of one file do not clobber each other, errors surface."""

from __future__ import annotations

import os

import pytest
import torch

from shardwise.zero.nvme_io import ALIGN, STATS, NvmeStore, empty_aligned


@pytest.mark.parametrize("direct", [True, False])
def test_regions_round_trip_at_any_offset_length_and_alignment(tmp_path, direct):
    store = NvmeStore(str(tmp_path), rank=0, threads=2, block_size=3 * ALIGN, queue_depth=4, direct=direct)
    if direct:
        assert store.direct == hasattr(os, "O_DIRECT")  # ext4/xfs under pytest's tmp allow it
    g = torch.Generator().manual_seed(0)
    # Adjacent regions of one file, some starting or ending inside a page, some spanning many blocks.
    sizes = [5, ALIGN // 4, 3 * ALIGN // 4 + 7, 10 * ALIGN // 4, 1, 40 * ALIGN // 4 + 3]
    regions, offset = [], 100
    for i, n in enumerate(sizes):
        aligned = i % 2 == 0
        buf = empty_aligned(n, torch.float32) if aligned else torch.empty(n + 1)[1:]  # the latter: off by 4 bytes
        buf.copy_(torch.randn(n, generator=g))
        regions.append((offset, buf))
        offset += n * 4 + (ALIGN - (offset + n * 4) % ALIGN if i == 2 else 0)  # one region aligned to a page
    written = STATS.write_bytes
    futures = [store.write_async("f.bin", buf, off) for off, buf in regions]  # all in flight together
    for f in futures:
        f.result()
    assert STATS.write_bytes - written == 4 * sum(sizes)
    back = [(off, empty_aligned(buf.numel(), torch.float32) if i % 3 else torch.empty(buf.numel()))
            for i, (off, buf) in enumerate(regions)]
    futures = [store.read_async("f.bin", out, off) for off, out in back]
    for f in futures:
        f.result()
    for (_, want), (_, got) in zip(regions, back):
        assert torch.equal(want, got)
    # An overwrite of one region leaves its neighbours alone.
    off, buf = regions[3]
    store.write_async("f.bin", torch.full_like(buf, 7.0), off).result()
    for i, (off, want) in enumerate(regions):
        got = torch.empty(want.numel())
        store.read_async("f.bin", got, off).result()
        assert torch.equal(got, torch.full_like(want, 7.0) if i == 3 else want), i
    assert store.disk_bytes() >= offset
    folder = store.dir
    store.close()
    assert not folder.exists()


def test_read_past_the_end_names_the_file(tmp_path):
    store = NvmeStore(str(tmp_path), rank=0)
    store.write_async("g.bin", torch.ones(ALIGN)).result()
    with pytest.raises(OSError, match="g.bin: file ends at byte"):
        store.read_async("g.bin", torch.empty(2 * ALIGN), 0).result()
    store.close()


def test_empty_aligned_is_aligned():
    for n in (1, 1000, 12345):
        t = empty_aligned(n, torch.bfloat16)
        assert t.numel() == n and t.dtype == torch.bfloat16 and t.data_ptr() % ALIGN == 0
