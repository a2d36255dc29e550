"""Real multi-host launches: two network namespaces joined by veth, an sshd in each.

Each namespace is a "host" with its own address, hostname and sshd (tests/netns_cluster.py);
the launcher runs on host 0 as a user would run it on the first node. These tests need root
(CI runs as root) and skip, saying why, otherwise.
"""
from __future__ import annotations

import importlib.metadata
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from netns_cluster import NetnsCluster, missing_requirements

REPO = Path(__file__).resolve().parents[1]
GPT = ["tests/scripts/gpt_param_hash.py", "--deepspeed", "--deepspeed_config",
       "examples/gpt/ds_config.json", "--steps", "3"]
RUN = [sys.executable, "-m", "shardwise", "run"]

pytestmark = pytest.mark.skipif(missing_requirements() is not None,
                                reason=str(missing_requirements()))


def _env(tmp: Path) -> dict[str, str]:
    """A clean environment plus a variable that only an env file sets (checks propagation)."""
    env_file = tmp / "cluster.env"
    env_file.write_text("# exported to every node\nSW_TEST_MARKER=from-env-file\n")
    return {"SHARDWISE_ENV_FILE": str(env_file), "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}


def _reports(stdout: str) -> dict[int, dict]:
    found = {}
    for m in re.finditer(r"^\[(\S+) rank(\d+)\]: REPORT (.*)$", stdout, re.MULTILINE):
        found[int(m.group(2))] = {"label": m.group(1), **json.loads(m.group(3))}
    return found


@pytest.fixture(scope="module")
def cluster():
    with NetnsCluster(2) as c:
        c.write_hostfile(["# two hosts, two ranks each", f"{c.hosts[0]} slots=2",
                          f"{c.hosts[1]} slots=2"])
        yield c


@pytest.fixture(scope="module")
def ssh_run(cluster, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ssh")
    return cluster.run(0, [*RUN, "--hostfile", cluster.hostfile, "--master_port", "29611",
                           *GPT, "--save_dir", str(tmp / "ck")],
                       env=_env(tmp), cwd=str(REPO), timeout=120)


def test_two_hosts_over_ssh_train_to_identical_parameters(cluster, ssh_run) -> None:
    assert ssh_run.returncode == 0, ssh_run.stderr
    assert "all 2 host(s) OK" in ssh_run.stderr  # the preflight doctor ran
    reports = _reports(ssh_run.stdout)
    assert sorted(reports) == [0, 1, 2, 3], ssh_run.stdout
    for rank, rep in reports.items():
        host = rank // 2  # ranks 0-1 on the first host of the hostfile, 2-3 on the second
        assert rep["host"] == cluster.hostnames[host] and rep["label"] == cluster.hosts[host]
        assert rep["world"] == 4 and rep["steps"] == 3
        assert rep["marker"] == "from-env-file"  # exported from SHARDWISE_ENV_FILE to every node
    assert len({rep["params"] for rep in reports.values()}) == 1  # identical parameters


def test_no_ssh_on_each_host_reaches_the_same_parameters(cluster, ssh_run, tmp_path) -> None:
    # --max_restarts also puts the nodes on the c10d rendezvous (the ssh run used the static one)
    procs = [cluster.popen(i, [*RUN, "--no_ssh", "--node_rank", str(i), "--num_nodes", "2",
                               "--num_procs", "2", "--master_addr", cluster.hosts[0],
                               "--master_port", "29612", "--max_restarts", "1",
                               *GPT, "--save_dir", str(tmp_path / "ck")],
                           env=_env(tmp_path), cwd=str(REPO)) for i in range(2)]
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=120)
            outs.append(out)
            assert p.returncode == 0, err
            assert f"rendezvous c10d {cluster.hosts[0]}:29612" in err
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    reports = {**_reports(outs[0]), **_reports(outs[1])}
    assert sorted(reports) == [0, 1, 2, 3]
    assert {r["host"] for r in reports.values()} == set(cluster.hostnames)
    ssh_params = {r["params"] for r in _reports(ssh_run.stdout).values()}
    assert {r["params"] for r in reports.values()} == ssh_params  # same seed, same result


def _only_sshd_left(cluster: NetnsCluster, deadline: float) -> list[int]:
    """Pids in the namespaces other than the two sshd listeners, once they are gone."""
    sshd = set()
    for proc in cluster.sshd:  # ip netns exec -> unshare -> sh -> exec sshd keeps the pid
        sshd.add(proc.pid)
    while True:
        others = [p for p in cluster.pids() if p not in sshd and
                  "sshd" not in Path(f"/proc/{p}/cmdline").read_text(errors="replace")]
        if not others or time.monotonic() > deadline:
            return others
        time.sleep(0.2)


def test_failure_or_ctrl_c_on_any_node_stops_every_node(cluster) -> None:
    script = ["tests/scripts/sleep_or_fail.py"]
    common = [*RUN, "--hostfile", cluster.hostfile, "--skip_doctor"]
    failed = cluster.run(0, [*common, "--master_port", "29613", *script, "--fail_rank", "3",
                             "--code", "7"], env={"PYTHONPATH": str(REPO)}, cwd=str(REPO),
                         timeout=90)
    assert failed.returncode == 7, failed.stderr  # the failed rank's exit code, through ssh
    assert f"[{cluster.hosts[1]} rank3]: rank 3 exits with 7" in failed.stderr
    assert f"[shardwise] node {cluster.hosts[1]} failed with exit code 7; the other nodes were " \
           "stopped" in failed.stderr
    assert not _only_sshd_left(cluster, time.monotonic() + 15), "processes outlived the job"

    proc = cluster.popen(0, [*common, "--master_port", "29614", *script],
                         env={"PYTHONPATH": str(REPO)}, cwd=str(REPO))
    deadline = time.monotonic() + 60
    ready = 0
    assert proc.stdout is not None
    while ready < 4 and time.monotonic() < deadline:  # every rank of both hosts is running
        line = proc.stdout.readline()
        ready += "]: ready pid=" in line
    assert ready == 4
    launcher = [p for p in cluster.pids()
                if "--hostfile" in Path(f"/proc/{p}/cmdline").read_text(errors="replace")]
    os.kill(launcher[0], signal.SIGINT)  # Ctrl-C reaches the launcher
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, err
    assert "stopped by SIGINT" in err
    assert not _only_sshd_left(cluster, time.monotonic() + 15), "processes outlived the job"


def test_pdsh_launcher(cluster) -> None:
    if subprocess.run(["which", "pdsh"], capture_output=True).returncode != 0:
        pytest.skip("pdsh is not installed (.ci/run installs it)")
    res = cluster.run(0, [*RUN, "--hostfile", cluster.hostfile, "--launcher", "pdsh",
                          "--skip_doctor", "--master_port", "29615",
                          "tests/scripts/allreduce_ok.py", "--tag", "p"],
                      env={"PYTHONPATH": str(REPO)}, cwd=str(REPO), timeout=90)
    assert res.returncode == 0, res.stderr
    reports = _reports(res.stdout)
    assert sorted(reports) == [0, 1, 2, 3]
    assert {reports[r]["label"] for r in (2, 3)} == {cluster.hosts[1]}  # %h -> node rank 1
    assert all(r["sum"] == 10.0 and r["world_size"] == 4 for r in reports.values())


def _fake_install(tmp: Path) -> dict[str, str]:
    """Files to mount over on one host: an older torch's metadata and an edited script."""
    dist = importlib.metadata.distribution("torch")
    meta = Path(dist.locate_file(f"torch-{dist.version}.dist-info/METADATA"))
    assert meta.is_file(), meta
    old = tmp / "METADATA"
    old.write_text(re.sub(r"^Version: .*$", "Version: 2.12.0", meta.read_text(),
                          count=1, flags=re.MULTILINE))
    script = REPO / "tests" / "scripts" / "allreduce_ok.py"
    edited = tmp / "allreduce_ok.py"
    edited.write_text(script.read_text() + "\n# edited on this host only\n")
    return {str(meta): str(old), str(script): str(edited)}


def test_doctor_names_unreachable_host_blocked_port_and_mismatches(tmp_path) -> None:
    with NetnsCluster(2, mounts={1: _fake_install(tmp_path)}) as c:
        port = "29616"
        # a firewall on host 0 drops the master port for host 1 only
        subprocess.run(["ip", "netns", "exec", c.names[0], "iptables", "-A", "INPUT", "-p", "tcp",
                        "--dport", port, "-s", c.hosts[1], "-j", "DROP"], check=True)
        unreachable = "10.77.0.3"  # on the subnet, but no host has it
        c.write_hostfile([f"{c.hosts[0]} slots=1", f"{c.hosts[1]} slots=1",
                          f"{unreachable} slots=1"])
        doctor = [sys.executable, "-m", "shardwise", "doctor", "--hostfile", c.hostfile]
        res = c.run(0, [*doctor, "--master_port", port, "tests/scripts/allreduce_ok.py"],
                    cwd=str(REPO), timeout=60)
        assert res.returncode == 1, res.stdout + res.stderr
        out = res.stdout
        assert re.search(rf"^{re.escape(unreachable)}\s+FAILED", out, re.MULTILINE), out
        assert f"{unreachable}: ssh failed: " in out
        assert f"{c.hosts[1]}: torch 2.12.0 differs from {importlib.metadata.version('torch')} " \
               "on this machine" in out
        assert f"{c.hosts[1]}: the script {REPO}/tests/scripts/allreduce_ok.py differs" in out
        assert f"{c.hosts[1]}: cannot connect to the master port {c.hosts[0]}:{port}: timed out" in out
        assert re.search(rf"^{re.escape(c.hosts[1])}\s+ok\s+\S+\s+2\.12\.0 \(!\)", out, re.MULTILINE)
        problems = out.split("problem(s)")[1].splitlines()[1:]
        assert len(problems) == 4 and not any(p.strip().startswith(f"{c.hosts[0]}:")
                                              for p in problems), out  # host 0 itself is fine

        # a master port already taken on node 0, found before the launch starts anything
        busy = c.popen(0, [sys.executable, "-c", "import socket,time; s=socket.socket(); "
                           f"s.bind(('{c.hosts[0]}', 29617)); s.listen(); print('up', flush=True); "
                           "time.sleep(60)"])
        assert busy.stdout is not None and busy.stdout.readline().strip() == "up"
        c.write_hostfile([f"{c.hosts[0]} slots=1", f"{c.hosts[1]} slots=1"])
        launch = c.run(0, [*RUN, "--hostfile", c.hostfile, "--master_port", "29617",
                           "tests/scripts/module_hello.py"], cwd=str(REPO), timeout=60)
        busy.kill()
        assert launch.returncode == 2, launch.stderr
        assert f"{c.hosts[0]}: master port {c.hosts[0]}:29617 cannot be opened there: " \
               "Address already in use" in launch.stderr
        assert "problem(s) found before launch" in launch.stderr and "--skip_doctor" in launch.stderr
        assert "launching" not in launch.stderr


def test_elastic_node_range_on_the_c10d_rendezvous(cluster) -> None:
    procs = [cluster.popen(i, [*RUN, "--no_ssh", "--elastic", "1:2", "--num_procs", "2",
                               "--master_addr", cluster.hosts[0], "--master_port", "29618",
                               "tests/scripts/allreduce_ok.py"],
                           env={"PYTHONPATH": str(REPO)}, cwd=str(REPO)) for i in range(2)]
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=90)
            assert p.returncode == 0, err
            assert "1-2 nodes (elastic), rendezvous c10d" in err
            outs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    reports = {**_reports(outs[0]), **_reports(outs[1])}
    assert sorted(reports) == [0, 1, 2, 3]  # both nodes joined one world of 4
    assert all(r["sum"] == 10.0 and r["world_size"] == 4 for r in reports.values())


def _netns_pids(cluster: NetnsCluster, i: int) -> list[int]:
    res = subprocess.run(["ip", "netns", "pids", cluster.names[i]], capture_output=True, text=True)
    return [int(p) for p in res.stdout.split()]


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text(errors="replace").replace("\0", " ")
    except (FileNotFoundError, ProcessLookupError):
        return ""


def _ready_ranks(proc: subprocess.Popen, count: int) -> dict[str, list[int]]:
    """host label -> pids of its ranks, from their 'ready pid=N' lines."""
    found: dict[str, list[int]] = {}
    deadline = time.monotonic() + 60
    assert proc.stdout is not None
    while sum(map(len, found.values())) < count and time.monotonic() < deadline:
        m = re.search(r"^\[(\S+) rank\d+\]: ready pid=(\d+)", proc.stdout.readline())
        if m:
            found.setdefault(m.group(1), []).append(int(m.group(2)))
    return found


def _gone(pids: list[int], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while True:
        alive = [p for p in pids if os.path.exists(f"/proc/{p}") and
                 Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[0] not in "ZX"]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.2)


def test_kill9_of_a_node_agent_or_the_launcher_leaves_no_orphans(cluster) -> None:
    """Multi-node: a SIGKILLed node agent takes its ranks down (and the job ends);
    a SIGKILLed fan-out launcher takes every node down."""
    common = [*RUN, "--hostfile", cluster.hostfile, "--skip_doctor", "tests/scripts/sleep_or_fail.py"]
    env = {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}

    proc = cluster.popen(0, [*RUN[:4], "--master_port", "29619", *common[4:]], env=env, cwd=str(REPO))
    try:
        ranks = _ready_ranks(proc, 4)
        assert sorted(map(len, ranks.values())) == [2, 2], ranks
        agent = [p for p in _netns_pids(cluster, 1) if "--no_ssh" in _cmdline(p) and "sh -c" not in _cmdline(p)]
        assert agent, "no node agent found on host 1"
        for pid in agent:
            os.kill(pid, signal.SIGKILL)
        assert not _gone(ranks[cluster.hosts[1]], 10), "host 1's ranks outlived their SIGKILLed node agent"
        _, err = proc.communicate(timeout=60)
        assert proc.returncode != 0 and f"to {cluster.hosts[1]} failed" in err, err  # ssh reports the kill
        assert not _only_sshd_left(cluster, time.monotonic() + 15), "processes outlived the job"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)

    proc = cluster.popen(0, [*RUN[:4], "--master_port", "29620", *common[4:]], env=env, cwd=str(REPO))
    try:
        ranks = _ready_ranks(proc, 4)
        assert sorted(map(len, ranks.values())) == [2, 2], ranks
        launcher = [p for p in _netns_pids(cluster, 0)
                    if "--hostfile" in _cmdline(p) and "sh -c" not in _cmdline(p)]
        assert launcher
        os.kill(launcher[0], signal.SIGKILL)
        left = _gone([p for pids in ranks.values() for p in pids], 20)
        assert not left, f"ranks {left} outlived the SIGKILLed launcher"
        assert not _only_sshd_left(cluster, time.monotonic() + 15), "processes outlived the job"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def test_network_partition_of_one_rank_is_reported_by_its_collective(cluster) -> None:
    """Fault injection: host 1's link goes down under a running job; host 0's rank reports the
    collective it was in, after the collective timeout, instead of hanging."""
    env = {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    procs = [cluster.popen(i, [*RUN, "--no_ssh", "--node_rank", str(i), "--num_nodes", "2", "--num_procs", "1",
                               "--master_addr", cluster.hosts[0], "--master_port", "29621", "--comm_timeout", "4",
                               "tests/scripts/allreduce_loop.py"], env=env, cwd=str(REPO)) for i in range(2)]
    try:
        out = procs[0].stdout
        assert out is not None
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if "step 3" in out.readline():
                break
        else:
            raise AssertionError("the job did not start")
        started = time.monotonic()
        subprocess.run(["ip", "-n", cluster.names[1], "link", "set", cluster.veths[1], "down"], check=True)
        _, err = procs[0].communicate(timeout=90)
        elapsed = time.monotonic() - started
        assert procs[0].returncode != 0, err
        assert re.search(r"rank 0: all_reduce #\d+ on world \(2 ranks\).*did not complete", err), err[-3000:]
        assert elapsed < 60, elapsed
    finally:
        subprocess.run(["ip", "-n", cluster.names[1], "link", "set", cluster.veths[1], "up"])
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
