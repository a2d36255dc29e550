"""Reduce-scatter and all-gather by direct point-to-point exchange (the gloo path of shardwise.comm).

Every rank builds every rank's input from a seed, so it knows the exact expected result:
the chunk sums in rank order, bit for bit.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from distributed import run_distributed

from shardwise import comm
from shardwise.comm import direct


def _inputs(world: int, numel: int, dtype: torch.dtype, salt: int) -> list[torch.Tensor]:
    return [torch.randn(numel, generator=torch.Generator().manual_seed(100 * salt + r)).to(dtype)
            for r in range(world)]


def _rank_order_sum(chunks: list[torch.Tensor]) -> torch.Tensor:
    out = chunks[0].clone()
    for c in chunks[1:]:
        out += c
    return out


def _body(rank: int, world: int) -> dict:
    assert direct.enabled(None, torch.zeros(1)), "the direct path should be on for gloo CPU tensors"
    checked = []
    size = 37  # odd on purpose
    for salt, (dtype, in_place, async_op) in enumerate([(torch.float32, True, True), (torch.float32, False, False),
                                                        (torch.bfloat16, True, False), (torch.float64, False, True)]):
        inputs = _inputs(world, world * size, dtype, salt)
        data = inputs[rank].clone()
        out = data[rank * size : (rank + 1) * size] if in_place else torch.empty(size, dtype=dtype)
        work = comm.reduce_scatter_tensor(out, data, async_op=async_op)
        if async_op:
            work.wait()
        want = _rank_order_sum([x[rank * size : (rank + 1) * size] for x in inputs])
        assert torch.equal(out, want), (dtype, in_place, (out - want).abs().max())
        if not in_place:  # the input is left as it was
            assert torch.equal(data, inputs[rank])

        gathered = torch.full((world * size,), -1.0, dtype=dtype)
        mine = gathered[rank * size : (rank + 1) * size] if in_place else torch.empty(size, dtype=dtype)
        mine.copy_(inputs[rank][:size])
        work = comm.all_gather_into_tensor(gathered, mine, async_op=async_op)
        if async_op:
            work.wait()
        assert torch.equal(gathered, torch.cat([x[:size] for x in inputs])), (dtype, in_place)
        checked.append(str(dtype))

    # Several exchanges in flight at once on one pair of ranks stay matched in order.
    bufs = [torch.full((world * 8,), float(10 * i + rank)) for i in range(4)]
    works = [comm.reduce_scatter_tensor(b[rank * 8 : (rank + 1) * 8], b, async_op=True) for b in bufs]
    for w in reversed(works):
        w.wait()
    for i, b in enumerate(bufs):
        assert torch.equal(b[rank * 8 : (rank + 1) * 8], torch.full((8,), float(sum(10 * i + r for r in range(world)))))

    # A sub-group whose group ranks differ from the global ranks.
    members = list(range(1, world))
    sub = comm.new_group(members)
    if rank in members:
        me = members.index(rank)
        n = len(members)
        inputs = _inputs(n, n * size, torch.float32, 99)
        out = torch.empty(size)
        comm.reduce_scatter_tensor(out, inputs[me].clone(), group=sub)
        assert torch.equal(out, _rank_order_sum([x[me * size : (me + 1) * size] for x in inputs]))
        gathered = torch.empty(n * size)
        comm.all_gather_into_tensor(gathered, inputs[me][:size].clone(), group=sub)
        assert torch.equal(gathered, torch.cat([x[:size] for x in inputs]))

    # A size that does not split evenly is refused with the sizes named.
    try:
        comm.reduce_scatter_tensor(torch.empty(3), torch.empty(3 * world + 1))
    except ValueError as exc:
        refused = str(exc)
    else:
        refused = ""
    dist.barrier()
    return {"checked": checked, "refused": refused}


def test_direct_reduce_scatter_and_all_gather_match_rank_order_sums() -> None:
    for res in run_distributed(_body, 3, timeout=120):
        assert res["checked"] == ["torch.float32", "torch.float32", "torch.bfloat16", "torch.float64"]
        assert "3 ranks x 3 output elements" in res["refused"]


def _native_body(rank: int, world: int) -> bool:
    return direct.enabled(None, torch.zeros(1))


def test_switch_turns_the_direct_path_off() -> None:
    assert run_distributed(_native_body, 2, env={"SHARDWISE_DIRECT_COLLECTIVES": "0"}) == [False, False]


def _skipping_body(rank: int, world: int) -> dict:
    import time

    comm.configure(timeout=2.0)
    comm.reduce_scatter_tensor(torch.empty(4), torch.ones(4 * world))
    if rank == 1:  # skips the next exchange
        time.sleep(4.0)
        return {}
    start = time.monotonic()
    try:
        comm.reduce_scatter_tensor(torch.empty(4), torch.ones(4 * world), async_op=True).wait()
    except comm.CollectiveTimeoutError as exc:
        return {"elapsed": time.monotonic() - start, "message": str(exc)}
    raise AssertionError("the exchange did not time out")


def test_a_missing_peer_times_out_after_the_configured_collective_timeout() -> None:
    """Point-to-point waits follow comm.configure(timeout=...), not the group's creation timeout."""
    res = run_distributed(_skipping_body, 2, timeout=60)[0]
    assert 1.5 < res["elapsed"] < 3.5, res
    assert res["message"].startswith("rank 0: reduce_scatter_tensor #2 on world (2 ranks)"), res["message"]
    assert "rank 1: not in a collective" in res["message"], res["message"]
