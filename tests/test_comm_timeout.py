"""A rank that stops calling collectives: every rank reports which collective it was in."""
from __future__ import annotations

import contextlib
import datetime
import io
import os
import re
import time

import pytest
import torch

from distributed import run_distributed

from shardwise import comm

TIMEOUT_S = 3.0


def _skipping_rank_body(rank: int, world: int) -> dict:
    comm.configure(timeout=TIMEOUT_S)
    for _ in range(2):
        comm.all_reduce(torch.ones(16))
    if rank == 1:  # stops calling collectives; its watchdog must still report
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            time.sleep(TIMEOUT_S + 2)
        return {"stderr": err.getvalue()}
    start = time.monotonic()
    try:
        comm.all_reduce(torch.ones(16, 4))
    except comm.CollectiveTimeoutError as exc:
        return {"message": str(exc), "op": exc.record.short(), "elapsed": time.monotonic() - start,
                "ranks": exc.ranks}
    raise AssertionError("the third all_reduce did not time out")


def test_every_rank_reports_the_collective_it_was_in() -> None:
    results = run_distributed(_skipping_rank_body, 3, timeout=60)
    for rank in (0, 2):
        r = results[rank]
        assert r["op"] == "all_reduce #3 on world"
        assert TIMEOUT_S - 0.5 < r["elapsed"] < TIMEOUT_S + 5, r["elapsed"]
        msg = r["message"]
        assert msg.startswith(f"rank {rank}: all_reduce #3 on world (3 ranks): float32[16x4], "
                              f"256 B did not complete (timed out) after"), msg
        assert f"(collective timeout {TIMEOUT_S:g} s)" in msg
        assert "where each rank was:" in msg
        # the two waiting ranks are grouped; the skipping rank is named with its last op
        assert "ranks 0,2: in all_reduce #3 on world for" in msg, msg
        assert re.search(r"rank 1: not in a collective for [\d.]+ s \(last completed: all_reduce #2 "
                         r"on world\); main thread at .*test_comm_timeout.py:\d+ in "
                         r"_skipping_rank_body", msg), msg
        assert "test_comm_timeout.py" in msg  # where rank 1's main thread was
        assert {s["rank"] for s in r["ranks"]} == {0, 1, 2}
    stuck = results[1]["stderr"]
    assert "rank 1 (" in stuck and "reported that all_reduce #3 on world timed out" in stuck, stuck
    assert re.search(r"this rank is not in a collective for [\d.]+ s \(last completed: "
                     r"all_reduce #2 on world\)", stuck), stuck
    assert "time.sleep(TIMEOUT_S + 2)" in stuck  # its main thread's position


def test_timeout_settings(monkeypatch) -> None:
    monkeypatch.delenv("SHARDWISE_COMM_TIMEOUT", raising=False)
    monkeypatch.delenv("DEEPSPEED_TIMEOUT", raising=False)
    assert comm.comm.resolve_timeout(None) == datetime.timedelta(minutes=30)
    monkeypatch.setenv("DEEPSPEED_TIMEOUT", "5")  # DeepSpeed's variable, in minutes
    assert comm.comm.resolve_timeout(None) == datetime.timedelta(minutes=5)
    assert comm.comm.resolve_timeout(datetime.timedelta(seconds=7)).total_seconds() == 7
    monkeypatch.setenv("SHARDWISE_COMM_TIMEOUT", "2.5")  # shardwise run --comm_timeout
    assert comm.comm.resolve_timeout(datetime.timedelta(seconds=7)).total_seconds() == 2.5
    monkeypatch.setenv("SHARDWISE_COMM_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="SHARDWISE_COMM_TIMEOUT='soon'"):
        comm.comm.resolve_timeout(None)
    monkeypatch.delenv("SHARDWISE_COMM_TIMEOUT")
    with pytest.raises(ValueError, match="comm_timeout must be a positive"):
        comm.configure(timeout=-1)
    assert os.environ.get("SHARDWISE_COMM_TIMEOUT") is None
