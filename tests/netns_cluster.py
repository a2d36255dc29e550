"""A cluster of "hosts" on this machine: network namespaces joined by veth, one sshd each.

    with NetnsCluster(2) as c:             # needs root, iproute2 and openssh-server
        c.hosts                             # ["10.77.0.1", "10.77.0.2"]
        c.run(0, [python, "-m", "shardwise", "run", "--hostfile", c.hostfile, ...])

Host i is namespace ``<prefix>-<i>`` with address 10.77.0.<i+1>/24, its own hostname
(``swhost<i>``, in a UTS namespace), an /etc/hosts naming every host (``ip netns exec``
mounts /etc/netns/<ns>/hosts), and an sshd that accepts a key generated for the test.
Host 0 and 1 are joined by one veth pair; a third host would need a bridge, so at most 2.
``SHARDWISE_SSH_ARGS`` tells the launcher's ssh to use that key. ``mounts`` replaces files
for one host's sshd only (a private mount namespace), to simulate a different install.

Everything is removed on exit, whatever happened: every process in the namespaces is
killed, then the namespaces, the veth pair and the /etc/netns folders are deleted.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path

SUBNET = "10.77.0"
SSHD = "/usr/sbin/sshd"


def missing_requirements() -> str | None:
    """Why this machine cannot host the cluster, or None."""
    if os.geteuid() != 0:
        return "needs root (network namespaces and sshd); CI runs as root"
    for tool in ("ip", "ssh", "ssh-keygen", "unshare", SSHD):
        if shutil.which(tool) is None and not os.path.exists(tool):
            return f"{tool} is not installed (.ci/run installs iproute2 and openssh-server)"
    return None


def _sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, check=check, timeout=30)


class NetnsCluster:
    _count = 0

    def __init__(self, n: int = 2, *, mounts: dict[int, dict[str, str]] | None = None) -> None:
        assert 1 <= n <= 2
        self.n = n
        self.mounts = mounts or {}
        NetnsCluster._count += 1  # several clusters may be alive in one process
        tag = f"{os.getpid() % 100000}{NetnsCluster._count % 10}"
        self.names = [f"sw{tag}-{i}" for i in range(n)]
        self.veths = [f"swv{tag}a", f"swv{tag}b"]
        self.hosts = [f"{SUBNET}.{i + 1}" for i in range(n)]
        self.hostnames = [f"swhost{i}" for i in range(n)]
        self.tmp = Path(tempfile.mkdtemp(prefix="shardwise-netns-"))
        self.sshd: list[subprocess.Popen] = []
        self.hostfile = str(self.tmp / "hostfile")
        self.env: dict[str, str] = {}

    # -- set-up -----------------------------------------------------------------------
    def __enter__(self) -> "NetnsCluster":
        try:
            self._network()
            self._keys()
            for i in range(self.n):
                self._start_sshd(i)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _network(self) -> None:
        hosts = "127.0.0.1 localhost\n" + "".join(
            f"{a} {h}\n" for a, h in zip(self.hosts, self.hostnames))
        for name in self.names:
            _sh("ip", "netns", "add", name)
            _sh("ip", "-n", name, "link", "set", "lo", "up")
            etc = Path("/etc/netns") / name
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(hosts)
        if self.n == 2:
            a, b = self.veths
            _sh("ip", "link", "add", a, "netns", self.names[0], "type", "veth", "peer", "name", b,
                "netns", self.names[1])
            for name, dev, addr in zip(self.names, self.veths, self.hosts):
                _sh("ip", "-n", name, "addr", "add", f"{addr}/24", "dev", dev)
                _sh("ip", "-n", name, "link", "set", dev, "up")
        else:
            _sh("ip", "-n", self.names[0], "addr", "add", f"{self.hosts[0]}/32", "dev", "lo")

    def _keys(self) -> None:
        for key in ("hostkey", "id"):
            _sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(self.tmp / key))
        shutil.copy(self.tmp / "id.pub", self.tmp / "authorized_keys")
        self.env["SHARDWISE_SSH_ARGS"] = (
            f"-i {self.tmp / 'id'} -o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null "
            f"-o LogLevel=ERROR -o IdentitiesOnly=yes")
        Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege separation folder

    def _start_sshd(self, i: int) -> None:
        cfg = self.tmp / f"sshd{i}.conf"
        cfg.write_text("\n".join([
            "Port 22", f"ListenAddress {self.hosts[i]}", f"HostKey {self.tmp / 'hostkey'}",
            f"PidFile {self.tmp / f'sshd{i}.pid'}", f"AuthorizedKeysFile {self.tmp / 'authorized_keys'}",
            "PermitRootLogin prohibit-password", "PasswordAuthentication no",
            "KbdInteractiveAuthentication no", "UsePAM no", "StrictModes no", "LogLevel INFO",
            "MaxStartups 100", "MaxSessions 100", ""]))
        setup = [f"hostname {self.hostnames[i]}"]
        for target, replacement in self.mounts.get(i, {}).items():
            setup.append(f"mount --bind {replacement} {target}")
        script = " && ".join(setup + [f'exec {SSHD} -D -e -f "$0"'])
        proc = subprocess.Popen(
            ["ip", "netns", "exec", self.names[i], "unshare", "--uts", "--mount",
             "--propagation", "private", "sh", "-c", script, str(cfg)],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.sshd.append(proc)
        assert proc.stderr is not None
        deadline = time.monotonic() + 15
        for line in proc.stderr:  # sshd -e logs to stderr; wait until it listens
            if "Server listening" in line:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"sshd on {self.hosts[i]} did not start: {line}")
        else:
            raise RuntimeError(f"sshd on {self.hosts[i]} exited with {proc.wait()}")
        threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()

    # -- use ------------------------------------------------------------------------
    def write_hostfile(self, lines: list[str]) -> str:
        Path(self.hostfile).write_text("\n".join(lines) + "\n")
        return self.hostfile

    def command(self, i: int, cmd: list[str]) -> list[str]:
        """``cmd`` as run on host i (its namespace and hostname), not through ssh."""
        return ["ip", "netns", "exec", self.names[i], "unshare", "--uts", "sh", "-c",
                f'hostname {self.hostnames[i]} && exec "$@"', "sh", *cmd]

    def popen(self, i: int, cmd: list[str], *, env: dict[str, str] | None = None,
              cwd: str | None = None) -> subprocess.Popen:
        return subprocess.Popen(self.command(i, cmd), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, cwd=cwd,
                                env={**os.environ, **self.env, **(env or {})},
                                start_new_session=True)

    def run(self, i: int, cmd: list[str], *, env: dict[str, str] | None = None,
            cwd: str | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
        proc = self.popen(i, cmd, env=env, cwd=cwd)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill_all()  # the launcher and what it started (ssh clients in sessions of their own)
            out, err = proc.communicate()
            raise AssertionError(f"timed out after {timeout} s on host {i}: {cmd}\n"
                                 f"stdout:\n{out}\nstderr:\n{err}") from None
        return subprocess.CompletedProcess(cmd, proc.returncode, out, err)

    # -- tear-down ------------------------------------------------------------------
    def pids(self) -> list[int]:
        found = []
        for name in self.names:
            res = _sh("ip", "netns", "pids", name, check=False)
            found += [int(p) for p in res.stdout.split()]
        return found

    def kill_all(self) -> None:
        """SIGKILL every process in the namespaces (sshd included)."""
        for pid in self.pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def close(self) -> None:
        self.kill_all()
        for proc in self.sshd:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        for name in self.names:
            _sh("ip", "netns", "del", name, check=False)  # also removes the veth pair
            shutil.rmtree(Path("/etc/netns") / name, ignore_errors=True)
        shutil.rmtree(self.tmp, ignore_errors=True)
