"""Hostfile, --include/--exclude, environment export and the fan-out commands (no processes)."""
from __future__ import annotations

import shlex
import sys

import pytest

from shardwise.cli import main
from shardwise.launcher import LaunchOptions, hostfile, runners
from shardwise.launcher.bind import core_block
from shardwise.launcher.environment import exported_env, parse_env_file
from shardwise.launcher.local import build_launch_config, plan_node
from shardwise.launcher.options import parse_elastic

HOSTS = """\
# two workers and a spare
worker-0 slots=4
worker-1   slots = 2   # fewer devices

spare slots=1
"""


def test_hostfile_lines_comments_and_blank_lines() -> None:
    hosts = hostfile.parse_hostfile(HOSTS, source="hosts")
    assert hosts == {"worker-0": [0, 1, 2, 3], "worker-1": [0, 1], "spare": [0]}
    assert list(hosts) == ["worker-0", "worker-1", "spare"]  # file order = node order


@pytest.mark.parametrize("text,message", [
    ("a slots=2\nb slots=two\n", "hosts:2: slots must be a positive integer, got 'two'"),
    ("a slots=2\nb\n", "hosts:2: expected 'hostname slots=N', got 'b'"),
    ("a slots=2\n\nb slots=1 gpus=2\n", "hosts:3: expected 'hostname slots=N'"),
    ("a slots=0\n", "hosts:1: slots must be a positive integer, got '0'"),
    ("a slots=1\n# c\na slots=2\n", "hosts:3: host 'a' is listed twice (first on line 1)"),
    ("# nothing\n\n", "hosts: no hosts listed"),
])
def test_bad_hostfile_lines_are_named_by_file_and_line(text: str, message: str) -> None:
    with pytest.raises(ValueError) as info:
        hostfile.parse_hostfile(text, source="hosts")
    assert str(info.value).startswith(message), str(info.value)


def test_include_exclude_num_nodes_num_gpus() -> None:
    hosts = hostfile.parse_hostfile(HOSTS)
    assert hostfile.apply_filters(hosts, include="worker-1:1@worker-0:0,2") == {
        "worker-0": [0, 2], "worker-1": [1]}  # hostfile order, not filter order
    assert hostfile.apply_filters(hosts, include="spare") == {"spare": [0]}
    assert hostfile.apply_filters(hosts, exclude="worker-0:1,3@spare") == {
        "worker-0": [0, 2], "worker-1": [0, 1]}
    assert hostfile.select(hosts, num_nodes=2, num_gpus=2) == {"worker-0": [0, 1],
                                                               "worker-1": [0, 1]}


@pytest.mark.parametrize("kwargs,message", [
    ({"include": "worker-9:0"}, "--include 'worker-9:0': unknown host 'worker-9' (the hostfile "
                                "lists worker-0, worker-1, spare)"),
    ({"exclude": "worker-1@nope"}, "--exclude 'worker-1@nope': unknown host 'nope'"),
    ({"include": "worker-1:0,2"}, "--include 'worker-1:0,2': host 'worker-1' has slots 0-1 "
                                  "(slots=2), no slot 2"),
    ({"include": "worker-1:x"}, "slot 'x' of host 'worker-1' is not a number"),
    ({"include": "worker-1@@spare"}, "empty entry"),
    ({"include": "spare", "exclude": "spare"}, "--include and --exclude cannot be combined"),
    ({"exclude": "worker-0@worker-1@spare"}, "leaves no host to run on"),
])
def test_filter_mistakes_name_the_host(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=None) as info:
        hostfile.apply_filters(hostfile.parse_hostfile(HOSTS), **kwargs)
    assert message in str(info.value), str(info.value)


def test_slots_exceeded_and_too_many_nodes() -> None:
    hosts = hostfile.parse_hostfile(HOSTS)
    with pytest.raises(ValueError, match=r"--num_gpus 3 is more than the slots of "
                                         r"worker-1 \(slots=2\), spare \(slots=1\)"):
        hostfile.select(hosts, num_gpus=3)
    with pytest.raises(ValueError, match="--num_nodes 4 asks for more hosts than the 3"):
        hostfile.select(hosts, num_nodes=4)


def test_cli_reports_hostfile_errors_before_launch(tmp_path, capsys) -> None:
    hf = tmp_path / "hosts"
    hf.write_text("good slots=1\nbad slots=-1\n")
    hf.with_name("two").write_text("localhost slots=2\n")
    script = tmp_path / "train.py"
    script.write_text("")
    cases = {
        ("--hostfile", str(hf), str(script)): f"{hf}:2: slots must be a positive integer",
        ("--hostfile", str(tmp_path / "missing"), str(script)): "cannot read it",
        ("--hostfile", str(hf.with_name("two")), "--include", "localhost:5", str(script)):
            "host 'localhost' has slots 0-1 (slots=2), no slot 5",
        ("--include", "localhost", "--num_procs", "2", str(script)):
            "--num_nodes/--num_gpus cannot be combined with --include/--exclude",
        ("--no_ssh", "--num_nodes", "2", "--master_addr", "10.0.0.1", str(script)):
            "--no_ssh on several nodes needs --node_rank",
        ("--no_ssh", "--num_nodes", "2", "--node_rank", "1", str(script)):
            "needs --master_addr",
        ("--no_ssh", "--num_nodes", "2", "--node_rank", "2", "--master_addr", "h", str(script)):
            "--node_rank 2 is not below the number of nodes (2)",
        ("--elastic", "3:1", str(script)): "--elastic '3:1': need 1 <= MIN <= MAX",
        ("--comm_timeout", "0", str(script)): "--comm_timeout must be a positive number",
        ("--num_nodes", "2", str(script)): "--num_nodes 2 needs a --hostfile",
    }
    for args, message in cases.items():
        with pytest.raises(SystemExit) as info:
            main(["run", *args])
        err = capsys.readouterr().err
        assert info.value.code == 2 and message in err, (args, err)


def test_env_files_and_prefixes(tmp_path) -> None:
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir()
    cwd.mkdir()
    (home / ".deepspeed_env").write_text("A=home\nB=home\n")
    (cwd / ".shardwise_env").write_text("# comment\n\nexport B=cwd=x\nC = spaced \n")
    environ = {"NCCL_DEBUG": "INFO", "PYTHONPATH": "/p", "HOME": "/h", "CUDA_HOME": "/c",
               "UNRELATED": "1"}
    env = exported_env(environ=environ, cwd=str(cwd), home=str(home))
    assert env == {"CUDA_HOME": "/c", "NCCL_DEBUG": "INFO", "PYTHONPATH": "/p", "A": "home",
                   "B": "cwd=x", "C": "spaced"}
    (cwd / ".shardwise_env").write_text("OK=1\nnot a pair\n")
    with pytest.raises(ValueError, match=r"\.shardwise_env:2: expected KEY=VALUE, got 'not a pair'"):
        parse_env_file(str(cwd / ".shardwise_env"))
    named = tmp_path / "custom.env"
    named.write_text("ONLY=this\n")
    assert exported_env(environ={"DS_ENV_FILE": str(named)}, cwd=str(cwd),
                        home=str(home)) == {"ONLY": "this"}


def _opts(**kw) -> LaunchOptions:
    return LaunchOptions(script="train.py", script_args=["--lr", "5%"], **kw)


def test_fan_out_commands() -> None:
    hosts = {"a": [0, 1], "b": [0]}
    env = {"NCCL_DEBUG": "INFO"}
    (host, ssh), (_, ssh_b) = runners.ssh_commands(_opts(ssh_port=2222, comm_timeout=9.0), hosts,
                                                   master_addr="a", master_port=9000, env=env,
                                                   cwd="/work dir")
    assert host == "a" and ssh[:6] == ["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=10",
                                       "-p"] and ssh[-2] == "a"
    remote = shlex.split(ssh[-1])
    assert remote[:6] == ["cd", "/work dir", "&&", "exec", "env", "NCCL_DEBUG=INFO"]
    agent = remote[6:]
    assert agent[:7] == [sys.executable, "-u", "-m", "shardwise", "run", "--no_ssh",
                         "--stop_with_parent"]
    world = agent[agent.index("--world_info") + 1]
    assert runners.decode_world_info(world) == hosts
    assert agent[agent.index("--local_addr") + 1] == "a" and "--comm_timeout" in agent
    assert agent[-3:] == ["train.py", "--lr", "5%"]
    assert shlex.split(ssh_b[-1])[agent.index("--local_addr") + 7] == "b"

    pdsh, pdsh_env = runners.pdsh_command(_opts(ssh_port=2222), hosts, master_addr="a",
                                          master_port=9000, env=env, cwd="/w")
    assert pdsh[:7] == ["pdsh", "-S", "-N", "-f", "1024", "-w", "a,b"]
    assert "--local_addr %h" in pdsh[-1] and "5%%" in pdsh[-1]  # the user's % stays literal
    assert pdsh_env["PDSH_RCMD_TYPE"] == "ssh" and "-p 2222" in pdsh_env["PDSH_SSH_ARGS_APPEND"]

    srun = runners.slurm_command(_opts(launcher_args="--exclusive"), hosts, master_addr="a",
                                 master_port=9000, env=env, cwd="/w")
    assert srun[:5] == ["srun", "--nodes=2", "--ntasks=2", "--ntasks-per-node=1",
                        "--nodelist=a,b"] and "--exclusive" in srun
    assert "--local_addr" not in srun  # node rank from SLURM_NODEID
    mpi = runners.mpi_command(_opts(), hosts, master_addr="a", master_port=9000, env=env, cwd="/w")
    assert mpi[:5] == ["mpirun", "-n", "2", "--host", "a:1,b:1"] and "NCCL_DEBUG=INFO" in mpi


def test_missing_launcher_program_is_named(monkeypatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(ValueError, match="--launcher slurm needs 'srun' on PATH"):
        runners.require_program("slurm")


def test_node_plans(monkeypatch) -> None:
    hosts = {"a": [0, 1], "b": [0, 1, 2]}
    plan = plan_node(_opts(no_ssh=True, local_addr="b", master_port=9000), hosts)
    assert (plan.node_rank, plan.nprocs, plan.master_addr, plan.rdzv_backend) == (1, 3, "a", "static")
    assert (plan.min_nodes, plan.max_nodes, plan.label) == (2, 2, "b")
    monkeypatch.setenv("SLURM_NODEID", "1")
    assert plan_node(_opts(no_ssh=True), hosts).node_rank == 1
    elastic = plan_node(_opts(no_ssh=True, elastic="1:4", master_addr="a"), None)
    assert (elastic.min_nodes, elastic.max_nodes, elastic.rdzv_backend) == (1, 4, "c10d")
    config = build_launch_config(elastic, max_restarts=3, log_dir="/tmp")
    assert (config.min_nodes, config.max_nodes, config.rdzv_backend) == (1, 4, "c10d")
    assert config.run_id == "shardwise"  # the same on every node
    restarting = plan_node(_opts(no_ssh=True, max_restarts=1), hosts)
    assert restarting.rdzv_backend == "c10d"  # restarts across nodes need the c10d rendezvous
    assert parse_elastic("2") == (2, 2)


def test_core_blocks() -> None:
    cores = [0, 1, 2, 3, 4, 5, 6]
    blocks = [core_block(cores, r, 3) for r in range(3)]
    assert blocks == [[0, 1, 2], [3, 4], [5, 6]]
    assert [core_block([4, 5], r, 3) for r in range(3)] == [[4], [5], [4]]
