"""The comms logger: counts, message sizes, bandwidth, op filters, and the engine's stage-0 traffic."""
from __future__ import annotations

import io
import logging

import pytest
import torch

from distributed import run_distributed, run_subtests

from shardwise import comm
from shardwise.comm.logger import CommsLogger, bus_factor

KB = 1024


def _all_ops_body(case: str, rank: int, world: int) -> dict:
    """Issue a known mix of collectives and return what the logger saw."""
    comm.configure(comms_logger={"enabled": True, "prof_all": case != "filtered",
                                 "prof_ops": ["all_reduce", "all_gather_base"],
                                 "debug": case == "debug", "verbose": case == "verbose"})
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    logging.getLogger("shardwise").addHandler(handler)
    logging.getLogger("shardwise").setLevel(logging.INFO)
    try:
        for _ in range(3):
            comm.all_reduce(torch.ones(256))  # 1 KiB
        comm.all_reduce(torch.ones(1024, dtype=torch.float64), async_op=True).wait()  # 8 KiB
        comm.broadcast(torch.zeros(64), src=0)  # 256 B
        out = torch.empty(world * 128)
        comm.all_gather_into_tensor(out, torch.full((128,), float(rank)))  # whole output
        assert out.tolist() == [float(r) for r in range(world) for _ in range(128)]
        comm.reduce_scatter_tensor(torch.empty(32), torch.ones(32 * world))
        comm.barrier()
        table = comm.log_summary(show_straggler=(case == "plain"))
    finally:
        logging.getLogger("shardwise").removeHandler(handler)
    summary = comm.comms_summary()
    comm.configure(comms_logger={"enabled": False})
    return {"summary": summary, "table": table, "log": stream.getvalue()}


def _logger_body(rank: int, world: int) -> list:
    return run_subtests(_all_ops_body, ["plain", "filtered", "debug", "verbose"], rank, world)


def test_counts_sizes_and_bandwidths_of_each_op() -> None:
    results = run_distributed(_logger_body, 2, timeout=120)
    for rank, (plain, filtered, debug, verbose) in enumerate(results):
        s = plain["summary"]
        assert {size: v["count"] for size, v in s["all_reduce"].items()} == {KB: 3, 8 * KB: 1}
        assert {size: v["count"] for size, v in s["broadcast"].items()} == {256: 1}
        assert list(s["all_gather_into_tensor"]) == [2 * 128 * 4]  # the gathered buffer
        assert list(s["reduce_scatter_tensor"]) == [2 * 32 * 4]  # the buffer reduced
        assert s["barrier"][0]["count"] == 1
        for op, sizes in s.items():
            for size, v in sizes.items():
                assert v["avg_latency_ms"] > 0
                assert v["total_latency_ms"] == pytest.approx(v["avg_latency_ms"] * v["count"])
                if size:
                    assert v["busbw_gbps"] == pytest.approx(v["algbw_gbps"] * bus_factor(op, 2))
        assert bus_factor("all_reduce", 2) == 1.0 and bus_factor("all_reduce", 4) == 1.5
        assert bus_factor("all_gather_into_tensor", 4) == 0.75
        # prof_all false: only the listed ops, DeepSpeed's alias all_gather_base included
        assert sorted(filtered["summary"]) == ["all_gather_into_tensor", "all_reduce"]
        # debug: the caller's function name is part of the op's name
        assert "all_reduce | [Caller Func: _all_ops_body]" in debug["summary"]
        if rank == 0:
            for op in ("all_reduce", "broadcast", "all_gather_into_tensor", "barrier"):
                assert op in plain["table"]
            assert "Straggler(ms)" in plain["table"] and "8.0 KiB" in plain["table"]
            # verbose: one line per logged op, on rank 0 only
            assert verbose["log"].count("comm op: all_reduce") == 4, verbose["log"]
        else:
            assert verbose["log"] == ""


def test_unknown_prof_op_is_named() -> None:
    with pytest.raises(ValueError, match=r"comms_logger.prof_ops: unknown op\(s\) \['allreduce'\]"):
        CommsLogger(prof_ops=["allreduce"])


def _stage0_body(rank: int, world: int, steps: int, gas: int) -> dict:
    import shardwise

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": gas,
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "zero_optimization": {"stage": 0, "reduce_bucket_size": 300},
              "comms_logger": {"enabled": True}}
    engine, _, _, _ = shardwise.initialize(model=model, model_parameters=model.parameters(),
                                           config=config)
    for _ in range(steps * gas):
        x = torch.randn(4, 16)
        engine.backward(engine(x).square().mean())
        engine.step()
    buckets = [b.numel * engine.strategy.groups[b.group_index].dtype.itemsize
               for b in engine.strategy.buckets]
    params = [p.numel() * p.element_size() for p in model.parameters()]
    summary = comm.comms_summary()
    comm.configure(comms_logger={"enabled": False})
    return {"summary": summary, "buckets": buckets, "params": params,
            "boundaries": engine.global_steps}


def test_stage0_traffic_equals_the_bucketing() -> None:
    steps, gas = 3, 2
    for result in run_distributed(_stage0_body, 2, args=(steps, gas), timeout=120):
        buckets = result["buckets"]
        assert len(buckets) >= 2  # 676 parameters, buckets of about 300 elements
        assert result["boundaries"] == steps
        s = result["summary"]
        expected: dict[int, int] = {}
        for size in buckets:  # one all_reduce per bucket per boundary step, none in between
            expected[size] = expected.get(size, 0) + steps
        assert {size: v["count"] for size, v in s["all_reduce"].items()} == expected
        total = sum(size * v["count"] for size, v in s["all_reduce"].items())
        assert total == steps * sum(buckets) == steps * 676 * 4
        expected_bc: dict[int, int] = {}
        for size in result["params"]:  # initialize broadcasts rank 0's parameters
            expected_bc[size] = expected_bc.get(size, 0) + 1
        assert {size: v["count"] for size, v in s["broadcast"].items()} == expected_bc
        assert set(s) == {"all_reduce", "broadcast"}
