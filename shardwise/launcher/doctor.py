"""``shardwise doctor``: check every host before a multi-node launch.

The usual reasons a multi-node job hangs or fails with "Connection refused", or trains
replicas that silently diverge, are found here in seconds:
* a host that ssh cannot reach (or that asks for a password);
* a master port that is taken on node 0, or that a firewall blocks from another node;
* a different python, torch or shardwise version on one host;
* a training script that differs between hosts (its sha256).

Each host runs ``probe.py`` (sent as source over ssh, with the environment the launch
would export); this machine's own versions and script are the reference.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from typing import TextIO

from . import runners
from .environment import exported_env
from .options import LaunchOptions

SSH_TIMEOUT = 5  # seconds for ssh to connect
PORT_TIMEOUT = 3.0  # seconds for a node to open a TCP connection to the master port
_PROBE_SOURCE = open(os.path.join(os.path.dirname(__file__), "probe.py")).read()


@dataclass
class HostReport:
    host: str
    info: dict = field(default_factory=dict)  # the probe's JSON, empty if ssh failed
    ssh_error: str | None = None
    port: str = "-"  # what this host saw of the master port
    problems: list[str] = field(default_factory=list)


def _pkg(dist: str) -> str | None:
    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def local_reference(script: str | None) -> dict:
    ref = {"python": platform.python_version(), "torch": _pkg("torch"),
           "shardwise": _pkg("shardwise"), "script": None}
    if script and os.path.isfile(script):
        with open(script, "rb") as f:
            ref["script"] = hashlib.sha256(f.read()).hexdigest()
    return ref


def _probe_cmd(opts: LaunchOptions, host: str, args: list[str], env: dict[str, str]) -> list[str]:
    probe = [sys.executable, "-c", _PROBE_SOURCE, *args]
    return [*runners.ssh_command(opts, connect_timeout=SSH_TIMEOUT), host,
            runners.remote_shell(probe, env, os.getcwd())]


def _call(cmd: list[str], timeout: float) -> tuple[dict | None, str]:
    """(the probe's JSON or None, an error text)."""
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                           stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return None, f"no answer within {timeout:g} s"
    if p.returncode == 0 and p.stdout.strip():
        try:
            return json.loads(p.stdout.strip().splitlines()[-1]), ""
        except ValueError:
            pass
    lines = [ln for ln in p.stderr.strip().splitlines() if ln.strip()]
    return None, (lines[-1] if lines else f"exit code {p.returncode}")


def check_hosts(opts: LaunchOptions, hosts: list[str], *, master_addr: str, master_port: int,
                script: str | None) -> list[HostReport]:
    env = exported_env()
    script_path = os.path.abspath(script) if script else None
    reports = {h: HostReport(h) for h in hosts}
    info_args = ["--script", script_path] if script_path else []
    with ThreadPoolExecutor(max_workers=min(32, len(hosts))) as pool:
        results = pool.map(lambda h: _call(_probe_cmd(opts, h, info_args, env), SSH_TIMEOUT + 20),
                           hosts)
        for h, (info, err) in zip(hosts, results):
            if info is None:
                reports[h].ssh_error = err
            else:
                reports[h].info = info
    _check_port(opts, reports, master_addr=master_addr, master_port=master_port, env=env)
    ref = local_reference(script_path)
    for r in reports.values():
        if r.ssh_error is not None:
            r.problems.append(f"{r.host}: ssh failed: {r.ssh_error}")
            continue
        for key in ("python", "torch", "shardwise"):
            if r.info.get(key) != ref[key]:
                r.problems.append(f"{r.host}: {key} {r.info.get(key) or 'not installed'} differs "
                                  f"from {ref[key]} on this machine")
        if script_path and r.info.get("script") != ref["script"]:
            what = "is missing" if r.info.get("script") is None else "differs from this machine's"
            r.problems.append(f"{r.host}: the script {script_path} {what} (sha256)")
    return list(reports.values())


def _check_port(opts: LaunchOptions, reports: dict[str, HostReport], *, master_addr: str,
                master_port: int, env: dict[str, str]) -> None:
    """Listen on the master port on node 0, then connect to it from every host."""
    hosts = list(reports)
    node0 = master_addr if master_addr in reports else hosts[0]
    target = f"{master_addr}:{master_port}"
    if reports[node0].ssh_error is not None:
        return
    seconds = SSH_TIMEOUT + PORT_TIMEOUT + 10
    listener = subprocess.Popen(_probe_cmd(opts, node0, ["--listen", target, "--seconds",
                                                         str(seconds)], env),
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                stdin=subprocess.PIPE, text=True)
    try:
        first = listener.stdout.readline() if listener.stdout else ""
        state = json.loads(first) if first.strip() else {"listen": False, "error": "no answer"}
        if not state.get("listen"):
            reports[node0].port = "in use"
            reports[node0].problems.append(f"{node0}: master port {target} cannot be opened "
                                           f"there: {state.get('error')}")
            return
        reports[node0].port = "free"
        others = [h for h in hosts if reports[h].ssh_error is None]
        args = ["--connect", target, "--seconds", str(PORT_TIMEOUT)]
        with ThreadPoolExecutor(max_workers=min(32, len(others))) as pool:
            answers = pool.map(lambda h: _call(_probe_cmd(opts, h, args, env),
                                               SSH_TIMEOUT + PORT_TIMEOUT + 10), others)
            for h, (res, err) in zip(others, answers):
                ok = res is not None and res.get("connect")
                why = err or (res or {}).get("error", "?")
                if h != node0:
                    reports[h].port = "reachable" if ok else "BLOCKED"
                if not ok:
                    reports[h].problems.append(f"{h}: cannot connect to the master port "
                                               f"{target}: {why}")
    finally:  # closing its stdin ends the remote listener and frees the port
        if listener.stdin:
            listener.stdin.close()
        try:
            listener.wait(timeout=SSH_TIMEOUT)
        except subprocess.TimeoutExpired:
            listener.kill()
            listener.wait()


def format_table(reports: list[HostReport], ref: dict, *, master: str) -> str:
    cols = ["host", "ssh", "python", "torch", "shardwise", "script", f"port {master}"]
    rows = []
    for r in reports:
        def cell(key: str, short: int | None = None) -> str:
            val = r.info.get(key)
            if r.ssh_error is not None:
                return "-"
            text = (val or "missing")[:short] if short else (val or "missing")
            return text + (" (!)" if val != ref.get(key) else "")
        rows.append([r.host, "FAILED" if r.ssh_error else "ok", cell("python"), cell("torch"),
                     cell("shardwise"), cell("script", 12) if ref.get("script") else "-", r.port])
    widths = [max(len(str(x)) for x in col) + 2 for col in zip(cols, *rows)]
    return "\n".join("".join(str(v).ljust(w) for v, w in zip(row, widths)).rstrip()
                     for row in [cols, *rows])


def run_doctor(opts: LaunchOptions, hosts: list[str], *, master_addr: str, master_port: int,
               script: str | None, out: TextIO) -> list[str]:
    """Check ``hosts``, print the table and the problems; return the problems."""
    start = time.monotonic()
    reports = check_hosts(opts, hosts, master_addr=master_addr, master_port=master_port,
                          script=script)
    ref = local_reference(os.path.abspath(script) if script else None)
    print(format_table(reports, ref, master=f"{master_addr}:{master_port}"), file=out)
    problems = [p for r in reports for p in r.problems]
    took = time.monotonic() - start
    if problems:
        print(f"{len(problems)} problem(s) ({took:.1f} s):", file=out)
        for p in problems:
            print(f"  {p}", file=out)
    else:
        print(f"all {len(hosts)} host(s) OK ({took:.1f} s)", file=out)
    out.flush()
    return problems


def preflight(opts: LaunchOptions, hosts: dict[str, list[int]], *, master_addr: str,
              master_port: int, out: TextIO) -> list[str]:
    """The doctor's checks before a multi-node launch (skipped with --skip_doctor)."""
    script = opts.script if not (opts.module or opts.no_python) else None
    print("[shardwise] checking the hosts before launch (shardwise doctor; --skip_doctor "
          "skips this):", file=out, flush=True)
    return run_doctor(opts, list(hosts), master_addr=master_addr, master_port=master_port,
                      script=script, out=out)


# ------------------------------------------------------------------------ the command

def add_doctor_arguments(parser) -> None:
    parser.add_argument("--hostfile", "-H", default=None, metavar="PATH",
                        help="lines 'hostname slots=N' (default /job/hostfile)")
    filters = parser.add_mutually_exclusive_group()
    filters.add_argument("--include", "-i", default="", metavar="SPEC")
    filters.add_argument("--exclude", "-e", default="", metavar="SPEC")
    parser.add_argument("--num_nodes", "--num-nodes", type=int, default=None, metavar="N")
    parser.add_argument("--master_addr", "--master-addr", default=None, metavar="ADDR",
                        help="default: the first host")
    parser.add_argument("--master_port", "--master-port", type=int, default=None, metavar="PORT",
                        help="default 29500")
    parser.add_argument("--ssh_port", "--ssh-port", type=int, default=None, metavar="PORT")
    parser.add_argument("script", nargs="?", default=None,
                        help="training script whose sha256 must match on every host")


def main(ns) -> int:
    """``shardwise doctor``: 0 when every check passes, 1 otherwise."""
    from . import hostfile
    from .options import DEFAULT_MASTER_PORT

    from .ds_package import deepspeed_package

    print(f"deepspeed: {deepspeed_package()[1]}")  # which one `import deepspeed` gives here
    hosts = hostfile.resolve(hostfile=ns.hostfile, include=ns.include, exclude=ns.exclude,
                             num_nodes=ns.num_nodes)
    if hosts is None:
        if ns.hostfile is None and ns.script is None:
            print(f"no hostfile ({hostfile.DEFAULT_HOSTFILE} does not exist): host checks skipped")
            return 0
        raise ValueError(f"--hostfile is required ({hostfile.DEFAULT_HOSTFILE} does not exist)")
    if ns.script is not None and not os.path.isfile(ns.script):
        raise ValueError(f"script not found: {ns.script!r}")
    opts = LaunchOptions(script=ns.script or "", ssh_port=ns.ssh_port)
    problems = run_doctor(opts, list(hosts), master_addr=ns.master_addr or next(iter(hosts)),
                          master_port=ns.master_port or DEFAULT_MASTER_PORT, script=ns.script,
                          out=sys.stdout)
    return 1 if problems else 0
