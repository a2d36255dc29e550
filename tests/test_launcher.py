"""Tests of `shardwise run`: real launches of the tiny scripts in tests/scripts/."""
from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from shardwise.cli import build_parser, main
from shardwise.launcher import LaunchOptions, options
from shardwise.launcher.local import exit_code_of, worker_command

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "tests" / "scripts"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(*args: str, env: dict[str, str] | None = None,
            timeout: float = 90) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    full_env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(SCRIPTS)])
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-m", "shardwise", "run", *args], cwd=REPO,
                          env=full_env, capture_output=True, text=True, timeout=timeout)


def _reports(stdout: str) -> dict[int, dict]:
    """REPORT lines keyed by the rank named in the launcher's line prefix."""
    found = {}
    for m in re.finditer(r"^\[rank(\d+)\]: REPORT (.*)$", stdout, re.MULTILINE):
        found[int(m.group(1))] = json.loads(m.group(2))
    return found


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def test_two_ranks_allreduce_with_prefixed_output() -> None:
    port = _free_port()
    tag = "a$$b${local_rank}"  # must reach the script untouched
    proc = _launch("--num_procs", "2", "--master_port", str(port),
                   "tests/scripts/allreduce_ok.py", "--tag", tag, "x", "y")
    assert proc.returncode == 0, proc.stderr
    reports = _reports(proc.stdout)
    assert sorted(reports) == [0, 1], proc.stdout
    for rank, rep in reports.items():
        env = rep["env"]
        assert rep["rank"] == rank and env["RANK"] == str(rank)
        assert env["LOCAL_RANK"] == str(rank)
        assert rep["local_rank_arg"] == int(env["LOCAL_RANK"])
        assert env["WORLD_SIZE"] == "2" and env["LOCAL_WORLD_SIZE"] == "2"
        assert rep["world_size"] == 2
        assert env["MASTER_ADDR"] == "127.0.0.1" and env["MASTER_PORT"] == str(port)
        assert env["OMP_NUM_THREADS"] == str(max(1, _cores() // 2))
        assert rep["sum"] == float(1 + 2)  # ranks contribute rank + 1
        assert rep["tag"] == tag and rep["rest"] == ["x", "y"]


def test_failing_rank_stops_the_others(tmp_path: Path) -> None:
    start = time.monotonic()
    proc = _launch("--num_procs", "2", "--master_port", str(_free_port()),
                   "tests/scripts/fail_rank1.py", str(tmp_path), timeout=60)
    elapsed = time.monotonic() - start
    assert proc.returncode == 1, proc.stderr  # python's exit code for an uncaught exception
    assert elapsed < 15, elapsed
    summary = [ln for ln in proc.stderr.splitlines() if ln.startswith("[shardwise]")]
    assert any(re.search(r"rank 1 \(local rank 1, pid \d+\) failed with exit code 1", ln)
               for ln in summary), proc.stderr
    assert any("RuntimeError: rank one gives up" in ln for ln in summary), proc.stderr
    assert "[rank0]: rank 0 sleeping" in proc.stdout  # rank 0 really was running
    pids = [int((tmp_path / f"rank{r}.pid").read_text()) for r in (0, 1)]
    deadline = time.monotonic() + 3
    alive = pids
    while alive and time.monotonic() < deadline:
        alive = [p for p in pids if _alive(p)]
        time.sleep(0.1)
    assert not alive, f"orphaned worker processes: {alive}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purposes
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return True


def test_exit_code_and_restarts() -> None:
    port = str(_free_port())
    failed = _launch("--num_procs", "1", "--master_port", port,
                     "tests/scripts/fail_first_attempt.py")
    assert failed.returncode == 7, failed.stderr
    restarted = _launch("--num_procs", "1", "--master_port", port, "--max_restarts", "1",
                        "tests/scripts/fail_first_attempt.py")
    assert restarted.returncode == 0, restarted.stderr
    assert "[rank0]: attempt 0" in restarted.stdout
    assert "[rank0]: attempt 1" in restarted.stdout


def test_module_pid_file_and_user_threads() -> None:
    proc = _launch("--num_procs", "1", "--save_pid", "--module", "module_hello", "a", "b",
                   env={"OMP_NUM_THREADS": "3"})
    assert proc.returncode == 0, proc.stderr
    rep = _reports(proc.stdout)[0]
    assert rep["argv"] == ["--local_rank=0", "a", "b"]
    assert rep["rank"] == "0"
    assert rep["omp"] == "3"  # the user's setting wins
    assert rep["pid_file"] == str(rep["launcher_pid"])
    assert not os.path.exists(os.path.join(tempfile.gettempdir(),
                                           f"{rep['launcher_pid']}.shardwise"))


def test_no_python_and_no_local_rank() -> None:
    proc = _launch("--num_procs", "1", "--no_python", "--no_local_rank", sys.executable,
                   "tests/scripts/module_hello.py", "z")
    assert proc.returncode == 0, proc.stderr
    assert _reports(proc.stdout)[0]["argv"] == ["z"]


def test_missing_script_fails_before_launch() -> None:
    proc = _launch("--num_procs", "2", "tests/scripts/does_not_exist.py", timeout=30)
    assert proc.returncode == 2, proc.stderr
    assert "script not found: 'tests/scripts/does_not_exist.py'" in proc.stderr
    assert "starting" not in proc.stderr


def test_bad_input_rejected_with_the_flag_named(capsys) -> None:
    hello = str(SCRIPTS / "module_hello.py")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        busy_port = str(busy.getsockname()[1])
        cases = {
            ("--num_procs", "0", hello): "--num_gpus/--num_procs must be at least 1, got 0",
            ("--master_port", "abc", hello): "--master_port",
            ("--master_port", "70000", hello): "--master_port must be in 1..65535",
            ("--master_port", busy_port, hello): f"--master_port {busy_port} is already in use",
            ("--max_restarts", "-1", hello): "--max_restarts must be 0 or more",
            ("--module", "no_such_module_xyz"): "no module named 'no_such_module_xyz'",
            ("--module", "--no_python", "module_hello"): "cannot be combined",
            ("--no_python", "no-such-program-xyz"): "program 'no-such-program-xyz' not found",
            ("--num_gpus", "1", "--num_procs", "1", hello): "not allowed with argument",
        }
        for args, message in cases.items():
            with pytest.raises(SystemExit) as info:
                main(["run", *args])
            err = capsys.readouterr().err
            assert info.value.code == 2, (args, err)
            assert message in err, (args, err)
            assert "starting" not in err, args


def test_busy_default_port_falls_back_to_a_free_one(monkeypatch) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        monkeypatch.setattr(options, "DEFAULT_MASTER_PORT", taken)
        port, note = options.resolve_master_port(LaunchOptions(script="x.py"))
        assert port != taken and options.port_is_free("127.0.0.1", port)
        assert note is not None and str(taken) in note and str(port) in note
        assert not options.port_is_free("127.0.0.1", taken)


def test_device_count_and_threads_rules() -> None:
    assert options.resolve_num_procs(None, accelerators=0, kind="cpu") == 1
    assert options.resolve_num_procs(None, accelerators=4, kind="cuda") == 4
    assert options.resolve_num_procs(3, accelerators=0, kind="cpu") == 3  # CPU ranks: any N
    with pytest.raises(ValueError, match="--num_gpus 8.*4 visible cuda"):
        options.resolve_num_procs(8, accelerators=4, kind="cuda")
    assert options.threads_per_rank(4, cores=2) == 1
    assert options.threads_per_rank(3, cores=16) == 5


def test_worker_command_shapes() -> None:
    prog, args = worker_command(LaunchOptions(script="train.py", script_args=["--lr", "1$"]))
    assert prog == sys.executable
    assert args == ["-u", "train.py", "--local_rank=${local_rank}", "--lr", "1$$"]
    prog, args = worker_command(LaunchOptions(script="pkg.train", module=True,
                                              no_local_rank=True))
    assert args == ["-u", "-m", "pkg.train"]
    assert exit_code_of(-9) == 128 + 9 and exit_code_of(3) == 3


def test_cli_remainder_goes_to_the_script() -> None:
    ns = build_parser().parse_args(["run", "--num_gpus", "2", "s.py", "--num_gpus", "5", "-m"])
    assert ns.num_procs == 2 and ns.script == "s.py"
    assert ns.script_args == ["--num_gpus", "5", "-m"] and not ns.module
