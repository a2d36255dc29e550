"""Tests of the multi-process harness in tests/distributed.py."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from distributed import DistributedTestError, run_distributed, run_subtests


# Bodies run in spawned processes, so they live at module level.

def _allreduce_body(rank: int, world_size: int, base: float, *, extra: int = 0) -> dict:
    import torch
    import torch.distributed as dist

    t = torch.tensor([base * (rank + 1), float(rank)])
    dist.all_reduce(t)
    names = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MY_FLAG", "CALLER_FLAG")
    return {"rank": rank, "sum": t.tolist(), "extra": extra, "pid": os.getpid(),
            "env": {n: os.environ.get(n) for n in names},
            "threads": torch.get_num_threads(), "dist_rank": dist.get_rank(),
            "dist_world": dist.get_world_size()}


def _raise_on_rank1(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("boom from rank one")
    time.sleep(60)  # rank 0 would sit here; the harness must not wait for it


def _skip_allreduce_on_rank1(rank: int, world_size: int) -> None:
    import torch
    import torch.distributed as dist

    if rank == 0:
        dist.all_reduce(torch.ones(3))  # rank 1 never joins


def _sleep_forever_on_rank1(rank: int, world_size: int, pid_dir: str) -> None:
    with open(os.path.join(pid_dir, f"pid{rank}"), "w") as f:
        f.write(str(os.getpid()))
    if rank == 1:
        _stuck_in_a_named_function()


def _stuck_in_a_named_function() -> None:
    time.sleep(600)


def _hard_exit_rank0(rank: int, world_size: int) -> None:
    if rank == 0:
        os._exit(3)
    time.sleep(60)


def _square(case: int, rank: int) -> int:
    if case == 3 and rank == 1:
        raise KeyError("bad sub-case")
    return case * case + rank


def _subtests_body(rank: int, world_size: int, cases: list[int]) -> list[int]:
    return run_subtests(_square, cases, rank)


@pytest.mark.parametrize("world_size", [2, 4])
def test_results_in_rank_order_and_allreduce(world_size: int, monkeypatch) -> None:
    # The ranks see the caller's environment as it is at the call (here set after the fork server
    # may have started), plus ``env``; nothing of an earlier call's ``env`` stays.
    run_distributed(_allreduce_body, 2, args=(0.0,), env={"CALLER_FLAG": "from an earlier call"})
    monkeypatch.setenv("CALLER_FLAG", f"caller {world_size}")
    results = run_distributed(_allreduce_body, world_size, args=(2.0,), kwargs={"extra": 7},
                              timeout=90, env={"MY_FLAG": "on"})
    assert [r["rank"] for r in results] == list(range(world_size))
    expected_sum = [2.0 * sum(range(1, world_size + 1)), float(sum(range(world_size)))]
    for rank, r in enumerate(results):
        assert r["sum"] == expected_sum
        assert r["extra"] == 7
        assert r["dist_rank"] == rank and r["dist_world"] == world_size
        assert r["threads"] == 1
        assert r["env"] == {"RANK": str(rank), "LOCAL_RANK": str(rank),
                            "WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE": str(world_size),
                            "MASTER_ADDR": "127.0.0.1", "MY_FLAG": "on",
                            "CALLER_FLAG": f"caller {world_size}"}
    assert len({r["pid"] for r in results}) == world_size
    assert os.getpid() not in {r["pid"] for r in results}


def test_raising_rank_reported_fast_with_traceback() -> None:
    start = time.monotonic()
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_raise_on_rank1, 2, timeout=60)
    elapsed = time.monotonic() - start
    err = info.value
    assert err.rank == 1
    text = str(err)
    assert "rank 1" in text
    assert "ValueError: boom from rank one" in text
    assert "_raise_on_rank1" in text  # the traceback names the failing function
    assert "Traceback (most recent call last)" in text
    # Spawning two torch processes takes a few seconds; waiting for the 60 s sleep or the
    # timeout would take far longer.
    assert elapsed < 30, elapsed


def test_rank_stuck_in_collective_is_named_with_stack() -> None:
    timeout = 8.0
    start = time.monotonic()
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_skip_allreduce_on_rank1, 2, timeout=timeout)
    elapsed = time.monotonic() - start
    err = info.value
    assert err.stuck_ranks == [0]
    assert "all_reduce" in err.details[0]
    assert "_skip_allreduce_on_rank1" in err.details[0]
    assert "all_reduce" in str(err) and "rank 0" in str(err)
    assert elapsed < timeout + 6, elapsed


def test_python_hang_times_out_and_leaves_no_process(tmp_path) -> None:
    timeout = 6.0
    start = time.monotonic()
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_sleep_forever_on_rank1, 2, args=(str(tmp_path),), timeout=timeout)
    elapsed = time.monotonic() - start
    err = info.value
    assert err.stuck_ranks == [1]
    assert "_stuck_in_a_named_function" in err.details[1]
    assert "stuck rank(s): 1" in str(err)
    assert timeout <= elapsed < timeout + 6, elapsed
    pids = [int((tmp_path / "pid0").read_text())]
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_rank_that_dies_without_exception() -> None:
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_hard_exit_rank0, 2, timeout=60, init_process_group=False)
    assert info.value.rank == 0
    assert "exit code 3" in str(info.value)


def test_subtests_share_one_group_and_name_the_failing_case() -> None:
    assert run_distributed(_subtests_body, 2, args=([0, 1, 2],), init_process_group=False,
                           timeout=60) == [[0, 1, 4], [1, 2, 5]]
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_subtests_body, 2, args=([2, 3],), init_process_group=False, timeout=60)
    assert info.value.rank == 1
    assert "sub-case 3" in str(info.value) and "KeyError" in str(info.value)


def test_bad_arguments_rejected_before_spawning() -> None:
    with pytest.raises(ValueError, match="world_size"):
        run_distributed(_square, 0)
    with pytest.raises(ValueError, match="timeout"):
        run_distributed(_square, 1, timeout=0)


def test_fresh_interpreter_ranks_see_env_before_any_import() -> None:
    # Forked ranks start with torch (and what the session imported) loaded; fresh ones import it
    # after ``env`` is set, so import-time settings reach them.
    fresh = run_distributed(_modules_at_start, 1, env={"MY_FLAG": "fresh"}, fresh_interpreter=True,
                            init_process_group=False, timeout=120)
    assert fresh == [{"forked": False, "torch_at_start": False, "flag": "fresh", "parent": os.getpid()}]
    forked = run_distributed(_modules_at_start, 2, init_process_group=False, timeout=60)
    assert all(r["forked"] and r["torch_at_start"] and r["parent"] != os.getpid() for r in forked), forked


_CHILD_SCRIPT = """
import os, sys, time
sys.path.insert(0, {tests!r})
from distributed import run_distributed
import test_harness
run_distributed(test_harness._write_pid_and_sleep, 1, args=({out!r},), timeout=300, init_process_group=False)
"""


def test_ranks_die_with_the_test_process(tmp_path) -> None:
    # The test process killed with SIGKILL (no cleanup runs): its ranks, and the fork server they
    # came from, go too, instead of sleeping on as orphans.
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    script = _CHILD_SCRIPT.format(tests=tests_dir, out=str(tmp_path))
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=tests_dir)
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "pid0").exists():
            assert proc.poll() is None, f"the harness process exited early ({proc.returncode})"
            assert time.monotonic() < deadline, "the ranks never started"
            time.sleep(0.2)
        pids = [int(p) for p in (tmp_path / "pid0").read_text().split()]  # the rank and its parent
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    deadline = time.monotonic() + 10
    alive = pids
    while alive and time.monotonic() < deadline:
        alive = [pid for pid in pids if _alive(pid)]
        time.sleep(0.1)
    assert not alive, f"processes {alive} (of rank, parent {pids}) outlived the killed test process"


def _modules_at_start(rank: int, world_size: int) -> dict:
    import distributed

    return {"forked": "_rank_preload" in sys.modules, "torch_at_start": distributed._TORCH_AT_START,
            "flag": os.environ.get("MY_FLAG"), "parent": os.getppid()}


def _write_pid_and_sleep(rank: int, world_size: int, out: str) -> None:
    with open(os.path.join(out, f"pid{rank}.tmp"), "w") as f:
        f.write(f"{os.getpid()} {os.getppid()}")
    os.rename(os.path.join(out, f"pid{rank}.tmp"), os.path.join(out, f"pid{rank}"))
    time.sleep(600)


def _alive(pid: int) -> bool:
    """Running (a zombie, dead but not yet reaped by whoever adopted it, is not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _register_exit_marker(rank: int, world_size: int, out: str) -> None:
    import atexit

    atexit.register(lambda: open(os.path.join(out, f"exited{rank}"), "w").close())


def test_a_rank_that_returns_runs_its_exit_hooks(tmp_path) -> None:
    # What a rank leaves to interpreter exit (atexit, weakref.finalize: swap folders, pending
    # writes) has run by the time the call returns, forked ranks included.
    run_distributed(_register_exit_marker, 2, args=(str(tmp_path),), timeout=60)
    assert sorted(os.listdir(tmp_path)) == ["exited0", "exited1"]
