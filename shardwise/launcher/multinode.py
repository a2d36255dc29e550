"""The multi-node fan-out: start a node agent on every host and supervise them.

The launcher machine runs one ``ssh`` per host (or a single pdsh, srun or mpirun). The
node agents print their ranks' output with ``[host rankN]: `` prefixes; ssh passes it
through. When one node fails, the others are stopped: their ssh clients are terminated,
which ends the remote sessions, and each agent (started with ``--stop_with_parent``)
then stops its workers. Ctrl-C or SIGTERM does the same for all nodes. The exit code is
the first failing node's (which is its first failing rank's).
"""
from __future__ import annotations

import collections
import os
import signal
import subprocess
import sys
import threading
import time
from typing import TextIO

from . import runners
from .environment import exported_env
from .options import DEFAULT_MASTER_PORT, LaunchOptions

STOP_GRACE = 10.0  # seconds the nodes get to stop their workers before their ssh is killed


def _stop_with_launcher_hook():
    """A ``preexec_fn`` giving each ssh (pdsh, srun, mpirun) SIGTERM when this launcher dies, even by
    SIGKILL: the remote session then ends and its agent (``--stop_with_parent``) stops its workers.
    The libc function is looked up here, before any fork; the child only calls it."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl
    return lambda: prctl(1, int(signal.SIGTERM), 0, 0, 0)  # PR_SET_PDEATHSIG


class _Node:
    def __init__(self, label: str, cmd: list[str], env: dict[str, str]) -> None:
        self.label = label
        self.tail: collections.deque[str] = collections.deque(maxlen=8)
        # A session of its own: Ctrl-C reaches only the launcher, which stops nodes in order.
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     env={**os.environ, **env}, start_new_session=True,
                                     preexec_fn=_stop_with_launcher_hook(),
                                     text=True, errors="replace", bufsize=1)
        self.ended_at: float | None = None
        self._pump = threading.Thread(target=self._copy_stderr, daemon=True)
        self._pump.start()

    def _copy_stderr(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.tail.append(line.rstrip("\n"))
            sys.stderr.write(line)
            sys.stderr.flush()

    def finish_output(self) -> None:
        self._pump.join(timeout=2)


def _start(opts: LaunchOptions, hosts: dict[str, list[int]], *, master_addr: str,
           master_port: int) -> list[_Node]:
    env = exported_env()
    cwd = os.getcwd()
    kw = dict(master_addr=master_addr, master_port=master_port, env=env, cwd=cwd)
    if opts.launcher == "ssh":
        return [_Node(host, cmd, {}) for host, cmd in runners.ssh_commands(opts, hosts, **kw)]
    if opts.launcher == "pdsh":
        cmd, pdsh_env = runners.pdsh_command(opts, hosts, **kw)
        return [_Node("pdsh", cmd, pdsh_env)]
    if opts.launcher == "slurm":
        return [_Node("srun", runners.slurm_command(opts, hosts, **kw), {})]
    return [_Node("mpirun", runners.mpi_command(opts, hosts, **kw), {})]


def _describe(node: _Node) -> str:
    code = node.proc.returncode
    if node.label in ("pdsh", "srun", "mpirun"):
        return f"{node.label} exited with code {code}"
    if code == 255:
        last = next((ln for ln in reversed(node.tail) if ln.strip()), "")
        return f"ssh to {node.label} failed (exit 255)" + (f": {last}" if last else "")
    if code is not None and code < 0:
        return f"node {node.label}: its ssh was killed by signal {-code}"
    return f"node {node.label} failed with exit code {code}"


def _stop(nodes: list[_Node]) -> None:
    running = [n for n in nodes if n.proc.poll() is None]
    for n in running:
        try:
            os.killpg(n.proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + STOP_GRACE
    for n in running:
        try:
            n.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(n.proc.pid, signal.SIGKILL)
            n.proc.wait()


def run(opts: LaunchOptions, hosts: dict[str, list[int]], *, out: TextIO | None = None) -> int:
    """Launch on every host of ``hosts``; return the exit code for ``shardwise run``."""
    out = out or sys.stderr

    def say(msg: str) -> None:
        print(f"[shardwise] {msg}", file=out, flush=True)

    runners.require_program(opts.launcher)
    master_addr = opts.master_addr or next(iter(hosts))
    master_port = opts.master_port or DEFAULT_MASTER_PORT
    if not opts.skip_doctor and opts.launcher in ("ssh", "pdsh"):
        from .doctor import preflight

        problems = preflight(opts, hosts, master_addr=master_addr, master_port=master_port,
                             out=out)
        if problems:
            raise ValueError(f"{len(problems)} problem(s) found before launch (table above): "
                             f"{problems[0]}{' ...' if len(problems) > 1 else ''}; fix them, "
                             f"or pass --skip_doctor to launch anyway")
    total = sum(len(s) for s in hosts.values())
    layout = ", ".join(f"{h} ({len(s)})" for h, s in hosts.items())
    say(f"launching {total} process(es) on {len(hosts)} nodes with {opts.launcher}: {layout}; "
        f"rendezvous {master_addr}:{master_port}")

    stop_signal: list[int] = []
    previous = {s: signal.signal(s, lambda signum, _f: stop_signal.append(signum))
                for s in (signal.SIGINT, signal.SIGTERM)}
    nodes: list[_Node] = []
    try:
        nodes = _start(opts, hosts, master_addr=master_addr, master_port=master_port)
        first: _Node | None = None
        while not stop_signal:
            for n in nodes:
                if n.ended_at is None and n.proc.poll() is not None:
                    n.ended_at = time.monotonic()
                    if n.proc.returncode != 0 and first is None:
                        first = n
            if first is not None or all(n.ended_at is not None for n in nodes):
                break
            time.sleep(0.1)
        _stop(nodes)
        for n in nodes:
            n.finish_output()
        if stop_signal:
            name = signal.Signals(stop_signal[0]).name
            say(f"stopped by {name}; every node was told to stop its workers")
            return 128 + stop_signal[0]
        if first is None:
            return 0
        say(_describe(first) + ("; the other nodes were stopped" if len(nodes) > 1 else ""))
        code = first.proc.returncode
        return code if code and code > 0 else 1
    finally:
        if nodes:
            _stop(nodes)
        for s, handler in previous.items():
            signal.signal(s, handler)
