"""ZeRO++'s block quantizer compiled with torch.compile (comm/quantize.py ``kernels``) gives the bits the
eager functions give: int8 and int4 codes, scales and dequantized values, for flat blocks (qwZ) and for
rows cut into blocks of uneven lengths (qgZ).

The rest of the suite runs the quantizer eagerly (``SHARDWISE_ZEROPP_COMPILE=0`` in tests/conftest.py: no
compile time in every rank of every multi-process test), so this file is what ties the two together.
"""

from __future__ import annotations

import pytest
import torch

from shardwise.comm import quantize as q


@pytest.mark.timeout(600)
def test_compiled_quantizer_gives_the_eager_bits(monkeypatch):
    g = torch.Generator().manual_seed(0)
    cases = [(256 * 38, 256)]  # (elements, block) (every size compiles apart: one is enough)
    monkeypatch.setenv("SHARDWISE_ZEROPP_COMPILE", "1")
    q.kernels.failed = None
    for n, block in cases:
        x = torch.randn(n, generator=g) * torch.logspace(-3, 2, n)[torch.randperm(n, generator=g)]
        x[:block] = 0  # an all-zero block
        for bits in (8, 4):
            with monkeypatch.context() as m:
                m.setenv("SHARDWISE_ZEROPP_COMPILE", "0")
                eager = q.quantize(x, block, bits)
                eager_x = q.dequantize(*eager, block, bits)
            got = q.quantize(x, block, bits)
            assert q.kernels.failed is None, q.kernels.failed
            assert f"quantize{bits}" in q.kernels.compiled
            assert torch.equal(got[0], eager[0]) and torch.equal(got[1], eager[1]), (n, block, bits)
            assert torch.equal(q.dequantize(*got, block, bits), eager_x), (n, block, bits)
            if bits == 8:  # qwZ's gather: 2 ranks' shards written straight into the rows of the weights
                for keep in (n, n - 5):  # whole blocks; padded shards (each row keeps its first n - 5)
                    into = torch.empty(2, keep)
                    q.dequantize_into(into, got[0].repeat(2), got[1].repeat(2), block, bits)
                    assert torch.equal(into, eager_x[:keep].repeat(2, 1)), (n, block, keep)
                assert f"dequantize_into{bits}" in q.kernels.compiled
            assert (eager_x - x).abs().max() <= q.error_bound(x, block, bits).max() + 1e-6 * x.abs().max()

    # qgZ's rows: 4 rows of 2 "parameters" cut into groups of 6 and 10 elements (the last one shorter; runs of
    # 2 elements in common), then blocks whose lengths share no factor (a byte's two int4 codes in two blocks)
    rows = torch.randn(4, 40, generator=g)
    even = torch.tensor([0] * 6 + [1] * 6 + [2] * 4 + [3] * 10 + [4] * 10 + [5] * 4)
    odd = torch.repeat_interleave(torch.arange(6), torch.tensor([3, 5, 7, 9, 4, 12]))
    for block_of in (even, odd):
        for bits in (8, 4):
            with monkeypatch.context() as m:
                m.setenv("SHARDWISE_ZEROPP_COMPILE", "0")
                eager = q.quantize_rows(rows, block_of, 6, bits)
                eager_x = q.dequantize_rows(*eager, block_of, bits)
                eager_sum = q.dequantize_rows_sum(*eager, block_of, bits, 2)
            got = q.quantize_rows(rows, block_of, 6, bits)
            assert f"quantize_rows{bits}" in q.kernels.compiled and q.kernels.failed is None, q.kernels.failed
            assert torch.equal(got[0], eager[0]) and torch.equal(got[1], eager[1]), bits
            assert torch.equal(q.dequantize_rows(*got, block_of, bits), eager_x), bits
            assert torch.equal(q.dequantize_rows_sum(*got, block_of, bits, 2), eager_sum), bits
            assert torch.equal(eager_sum, eager_x[:2] + eager_x[2:]), bits
            step = eager[1].gather(1, block_of.expand(4, -1))  # each element's block scale
            assert torch.all((eager_x - rows).abs() <= step + 1e-6), bits
            assert 0 < (eager_x - rows).abs().max() < rows.abs().max() / 2 ** (bits - 2)


def test_compile_switch_and_failure_fall_back_to_eager(monkeypatch):
    x = torch.randn(512)
    monkeypatch.setenv("SHARDWISE_ZEROPP_COMPILE", "0")
    kernels = q._Kernels()
    calls = []
    kernels.compiled["f"] = lambda *a: calls.append("compiled")
    assert kernels("f", lambda t: "eager", x) == "eager" and calls == []
    monkeypatch.setenv("SHARDWISE_ZEROPP_COMPILE", "1")

    def broken(*_):
        raise RuntimeError("no C++ compiler\ndetails")

    kernels.compiled["f"] = broken
    assert kernels("f", lambda t: "eager", x) == "eager"
    assert kernels.failed == "RuntimeError: no C++ compiler" and not kernels.enabled()
    assert kernels("f", lambda t: "eager again", x) == "eager again"
