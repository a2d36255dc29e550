"""The 1-bit compressed all-reduce (shardwise.comm.compressed) at 4 ranks and on a 2-rank subgroup.

Every rank rebuilds every rank's input from a seed, so it computes the expected result itself,
with a separate (numpy) implementation of the sign/scale arithmetic.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist

from distributed import run_distributed, run_subtests

from shardwise import comm
from shardwise.comm import compressed


def test_pack_signs_matches_numpy_packbits():
    x = torch.randn(5, 48, generator=torch.Generator().manual_seed(0))
    x[0, :5] = 0.0  # zero counts as positive
    packed = compressed.pack_signs(x >= 0)
    assert packed.dtype == torch.uint8 and packed.shape == (5, 6)
    assert np.array_equal(packed.numpy(), np.packbits((x >= 0).numpy(), axis=-1))
    signs = compressed.unpack_signs(packed)
    assert torch.equal(signs, torch.where(x >= 0, 1.0, -1.0))
    with pytest.raises(ValueError, match="multiple of 8"):
        compressed.pack_signs(torch.ones(7, dtype=torch.bool))


def test_sizes():
    assert compressed.padded_size(1000, 4) == 1024 and compressed.padded_size(1, 2) == 16
    # 4 ranks, 1024 padded elements: 256 per chunk -> 32 bytes of signs + 4 of scale, per rank
    assert compressed.message_bytes(1000, 4) == 4 * (32 + 4)
    # tensors of 300 and 700: chunk 1 ([256, 512)) holds pieces of both -> every row carries 2 scales
    assert compressed.message_bytes(1000, 4, [300, 700]) == 4 * (32 + 8)
    with pytest.raises(ValueError, match="do not add up"):
        compressed.message_bytes(1000, 4, [300, 600])
    w, s = compressed.error_buffers(1000, 4)
    assert w.numel() == 1024 and s.numel() == 256


def _inputs(n: int, numel: int, step: int) -> list[np.ndarray]:
    """Rank r's tensor at ``step``: a steady part (so sums grow) plus noise, in float32."""
    out = []
    for r in range(n):
        rng = np.random.default_rng(1000 * step + r)
        steady = np.linspace(-1, 1, numel, dtype=np.float32) * (1 + r)
        out.append((steady + rng.standard_normal(numel).astype(np.float32)).astype(np.float32))
    return out


def _sign_times_rms(v: np.ndarray, pieces: list[slice]) -> np.ndarray:
    """Each piece of ``v`` replaced by its root mean square times its signs (0 counts as +)."""
    out = np.zeros_like(v)
    for piece in pieces:
        part = v[piece]
        scale = np.float32(np.sqrt((part.astype(np.float64) ** 2).mean())) if part.size else 0
        out[piece] = np.where(part >= 0, scale, -scale)
    return out


def _reference_one_call(xs: list[np.ndarray], sizes: list[int]) -> np.ndarray:
    """The compressed average of ``xs`` from zero error buffers, written independently in numpy:
    rank j's chunk of each input, cut at the tensor boundaries, as +-rms; averaged; again +-rms."""
    n, numel = len(xs), xs[0].size
    chunk = compressed.padded_size(numel, n) // n
    bounds = np.cumsum([0, *sizes])
    out = np.zeros(numel, np.float32)
    for j in range(n):
        lo, hi = min(j * chunk, numel), min((j + 1) * chunk, numel)
        cuts = sorted({lo, hi, *(int(b) for b in bounds if lo < b < hi)})
        pieces = [slice(a - lo, b - lo) for a, b in zip(cuts, cuts[1:])]
        recon = [_sign_times_rms(x[lo:hi], pieces) for x in xs]
        avg = np.sum(recon, axis=0, dtype=np.float32) / n
        out[lo:hi] = _sign_times_rms(avg, pieces)
    return out


def _case(case, rank: int, world: int, subgroup, sub_ranks) -> str:
    label, numel, sizes = case
    group = subgroup if label == "subgroup" else None
    members = sub_ranks if label == "subgroup" else list(range(world))
    if rank not in members:
        return "not a member"
    n = len(members)
    me = members.index(rank)

    # 1. one call from zero errors: matches the independent numpy reference (sign and scale per chunk)
    xs = _inputs(n, numel, 0)
    t = torch.from_numpy(xs[me].copy())
    worker, server = compressed.error_buffers(numel, n)
    comm.reset_comms_log()
    compressed.compressed_all_reduce(t, worker, server, group=group, sizes=sizes)
    want = _reference_one_call(xs, sizes or [numel])
    assert np.allclose(t.numpy(), want, rtol=1e-5, atol=1e-6), np.abs(t.numpy() - want).max()
    # every rank gets the same result (it was broadcast as packed bits + scales)
    everyone = [torch.empty_like(t) for _ in range(n)]
    dist.all_gather(everyone, t, group=group)
    assert all(torch.equal(e, t) for e in everyone)

    # 2. the comms logger records both phases with the bytes really sent
    logged = comm.comms_summary()
    size = compressed.message_bytes(numel, n, sizes)
    assert list(logged["compressed_all_to_all"]) == [size], logged
    assert list(logged["compressed_all_gather"]) == [size], logged
    assert logged["compressed_all_to_all"][size]["count"] == 1

    # 3. inputs that are exactly +-scale per chunk, the same on every rank, come through exactly
    padded = compressed.padded_size(numel, n)
    pattern = torch.where(torch.arange(numel) % 3 == 0, -1.0, 1.0)
    per_chunk = (torch.arange(numel) // (padded // n)).float() + 0.5
    exact = pattern * per_chunk
    worker, server = compressed.error_buffers(numel, n)
    got = compressed.compressed_all_reduce(exact.clone(), worker, server, group=group, sizes=sizes)
    assert torch.allclose(got, exact, rtol=1e-6, atol=0), (got - exact).abs().max()
    assert float(worker.abs().max()) < 1e-5 and float(server.abs().max()) < 1e-5

    # 4. error feedback over many calls: sum(outputs) == sum(true averages) - mean(worker errors) - server
    #    error, exactly up to float rounding; the errors stay bounded while the sums grow.
    worker, server = compressed.error_buffers(numel, n)
    sum_out = np.zeros(numel, np.float64)
    sum_true = np.zeros(numel, np.float64)
    err_norms = []
    steps = 30
    for step in range(1, steps + 1):
        xs = _inputs(n, numel, step)
        t = torch.from_numpy(xs[me].copy())
        compressed.compressed_all_reduce(t, worker, server, group=group, sizes=sizes)
        sum_out += t.numpy()
        sum_true += np.mean(np.stack(xs).astype(np.float64), axis=0)
        err_norms.append(float(worker.norm()))
    workers = [torch.empty_like(worker) for _ in range(n)]
    dist.all_gather(workers, worker, group=group)
    servers = [torch.empty_like(server) for _ in range(n)]
    dist.all_gather(servers, server, group=group)
    mean_worker = torch.stack(workers).double().mean(0)[:numel].numpy()
    server_all = torch.cat(servers).double()[:numel].numpy()
    identity = sum_true - mean_worker - server_all
    assert np.allclose(sum_out, identity, rtol=0, atol=1e-3 * steps), np.abs(sum_out - identity).max()
    # without the error terms the running sums differ by far more: the identity is not vacuous
    assert np.abs(sum_out - sum_true).max() > 100 * np.abs(sum_out - identity).max()
    assert max(err_norms[-10:]) < 3 * max(err_norms[:10]), err_norms
    # the decompressed running mean tracks the true one: relative error shrinks with the number of calls
    rel = np.linalg.norm(sum_out - sum_true) / np.linalg.norm(sum_true)
    assert rel < 0.1, rel
    return f"{label} n={n} numel={numel} rel={rel:.4f}"


def _body(rank: int, world: int) -> list:
    comm.configure(comms_logger={"enabled": True})
    sub_ranks = [1, 3]  # not contiguous: group ranks differ from global ranks
    subgroup = comm.new_group(sub_ranks)
    out = run_subtests(_case, [("world", 1000 + 3, None), ("world", 64, None), ("world", 1003, [300, 7, 500, 196]),
                               ("subgroup", 777, [700, 77])],
                       rank, world, subgroup, sub_ranks)

    # comm_backend_name: gloo / compressed accepted, nccl / mpi refused with the reason
    assert compressed.check_backend("gloo") == "gloo"
    assert compressed.check_backend("compressed") == "gloo"
    assert compressed.check_backend(None) == "gloo"
    for bad, words in (("nccl", "runs 'gloo'"), ("mpi", "mpi4py"), ("ucx", "unknown backend")):
        try:
            compressed.check_backend(bad)
        except ValueError as e:
            assert "comm_backend_name" in str(e) and words in str(e), str(e)
        else:
            raise AssertionError(f"{bad} accepted on gloo")
    return out


def test_compressed_all_reduce_4_ranks_and_2_rank_subgroup():
    results = run_distributed(_body, 4, timeout=120)
    assert results[1][3].startswith("subgroup n=2")
    assert results[0][3] == "not a member"
