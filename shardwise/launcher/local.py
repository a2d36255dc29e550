"""Start this node's worker processes through torch's elastic agent; report how they ended.

The agent (``torch.distributed.launcher.api.elastic_launch``) owns the processes: it sets
RANK/LOCAL_RANK/WORLD_SIZE/LOCAL_WORLD_SIZE/MASTER_ADDR/MASTER_PORT, meets the other
nodes' agents at the rendezvous, streams each worker's output with a ``[rank<n>]: `` (or
``[<host> rank<n>]: ``) prefix, stops the whole group when one worker fails and restarts it
up to ``max_restarts`` times. This module only turns :class:`LaunchOptions` into a
:class:`NodePlan` and the agent's configuration, and the outcome into an exit code and a
readable summary. A single-node launch and one node of a multi-node job (``--no_ssh``,
which is also what the fan-out runs on every host) differ only in their plan.
"""
from __future__ import annotations

import contextlib
import glob
import os
import re
import shlex
import shutil
import signal
import socket
import sys
import tempfile
import uuid
from dataclasses import dataclass
from typing import Iterator, TextIO

from .ds_flags import wrap_worker
from .options import (DEFAULT_MASTER_ADDR, DEFAULT_MASTER_PORT, LaunchOptions, count_accelerators,
                      parse_elastic, port_is_free, resolve_master_port, resolve_num_procs,
                      threads_per_rank, usable_cores, validate)

LOG_LINE_PREFIX = "[rank${rank}]: "
MONITOR_INTERVAL = 0.1  # seconds between the agent's health checks of the workers
SHUTDOWN_TIMEOUT = 5  # seconds the agent gives workers after SIGTERM before SIGKILL
_LOCAL_RANK_MACRO = "${local_rank}"  # replaced per worker by the agent


def worker_command(opts: LaunchOptions, *, bind_nprocs: int | None = None) -> tuple[str, list[str]]:
    """The program each worker runs and its arguments (with the local-rank macro).

    With ``bind_nprocs`` the worker first goes through ``shardwise.launcher.bind``, which
    pins it to its share of the cores and then becomes the real program.
    """
    # The agent expands ${...} templates in every argument; double each '$' of the user's
    # arguments so they reach the script unchanged.
    user_args = [a.replace("$", "$$") for a in opts.script_args]
    local_rank = [] if opts.no_local_rank else [f"--local_rank={_LOCAL_RANK_MACRO}"]
    python = os.environ.get("PYTHON_EXEC", sys.executable)
    if opts.no_python:
        program = shutil.which(opts.script) or opts.script
        args = [*local_rank, *user_args]
    else:
        target = ["-m", opts.script] if opts.module else [opts.script]
        program, args = python, ["-u", *target, *local_rank, *user_args]
    program, args = wrap_worker(opts, program, args)  # --venv_script, --enable_each_rank_log (ds_flags.py)
    if bind_nprocs is not None:
        return python, ["-m", "shardwise.launcher.bind", _LOCAL_RANK_MACRO, str(bind_nprocs),
                        "--", program, *args]
    return program, args


def guarded(program: str, args: list[str], *, launcher_pid: int) -> tuple[str, list[str]]:
    """Run ``program`` through guard.py, which makes the worker die with this launcher (no orphans
    when the launcher or node agent is killed with SIGKILL; see guard.py)."""
    guard = os.path.join(os.path.dirname(os.path.abspath(__file__)), "guard.py")
    python = os.environ.get("PYTHON_EXEC", sys.executable)
    return python, [guard, str(launcher_pid), "--", program, *args]


@dataclass
class NodePlan:
    """What this node's agent runs: its processes and how it meets the other nodes."""

    nprocs: int
    master_addr: str
    master_port: int
    min_nodes: int = 1
    max_nodes: int = 1
    node_rank: int = 0
    rdzv_backend: str = "static"  # "c10d" for elastic node counts and multi-node restarts
    local_addr: str | None = None
    label: str | None = None  # host name in output prefixes; None on a single node
    slots: list[int] | None = None


def build_launch_config(plan: NodePlan, *, max_restarts: int, log_dir: str):
    """The elastic agent's LaunchConfig for this node."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.launcher.api import LaunchConfig

    shutdown = int(os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", SHUTDOWN_TIMEOUT))
    prefix = LOG_LINE_PREFIX if plan.label is None else f"[{plan.label} rank${{rank}}]: "
    configs = {"rank": plan.node_rank} if plan.rdzv_backend == "static" else {}
    return LaunchConfig(
        min_nodes=plan.min_nodes, max_nodes=plan.max_nodes, nproc_per_node=plan.nprocs,
        # every node of a job must use the same run id; a single node may pick any
        run_id=os.environ.get("SHARDWISE_RUN_ID") or (
            "shardwise" if plan.max_nodes > 1 else f"shardwise-{uuid.uuid4().hex[:12]}"),
        rdzv_backend=plan.rdzv_backend, rdzv_endpoint=f"{plan.master_addr}:{plan.master_port}",
        rdzv_configs=configs, local_addr=plan.local_addr,
        max_restarts=max_restarts, monitor_interval=MONITOR_INTERVAL,
        # tee = write each stream to a log file and echo it, prefixed, to our console
        logs_specs=DefaultLogsSpecs(log_dir=log_dir, tee=Std.ALL),
        log_line_prefix_template=prefix,
        shutdown_timeout=shutdown,
        # SIGINT is turned into the SIGTERM shutdown by run() (see _stop_workers_with_sigterm_on_sigint)
        signals_to_handle="SIGTERM,SIGHUP,SIGQUIT",
    )


_NODE_RANK_VARS = ("SLURM_NODEID", "OMPI_COMM_WORLD_RANK", "PMI_RANK")


def plan_local(opts: LaunchOptions, *, slots: list[int] | None = None) -> tuple[NodePlan, str | None]:
    """A single-node launch on this machine; (plan, a note about the port or None)."""
    addr = opts.master_addr or DEFAULT_MASTER_ADDR
    port, note = resolve_master_port(opts, addr)
    if slots is not None and opts.num_procs is None:
        nprocs = len(slots)
    else:
        accelerators, kind = count_accelerators()
        nprocs = resolve_num_procs(opts.num_procs, accelerators=accelerators, kind=kind)
    # Restarts need a fresh store per attempt: torch's static rendezvous keeps one store,
    # whose stale keys make a restarted group hang, so restarts use the c10d rendezvous
    # (with a new store per round, see run()).
    backend = "c10d" if opts.max_restarts > 0 else "static"
    return NodePlan(nprocs=nprocs, master_addr=addr, master_port=port, slots=slots,
                    rdzv_backend=backend), note


def plan_node(opts: LaunchOptions, hosts: dict[str, list[int]] | None) -> NodePlan:
    """This node's share of a multi-node job (``--no_ssh``, or started by the fan-out)."""
    if opts.elastic is not None:
        min_nodes, max_nodes = parse_elastic(opts.elastic)
    else:
        min_nodes = max_nodes = opts.num_nodes or (len(hosts) if hosts else 1)
    elastic = opts.elastic is not None or (max_nodes > 1 and opts.max_restarts > 0)
    node_rank = opts.node_rank
    if node_rank is None and hosts and opts.local_addr in hosts:
        node_rank = list(hosts).index(opts.local_addr)  # started by the ssh/pdsh fan-out
    if node_rank is None:
        found = [(v, os.environ[v]) for v in _NODE_RANK_VARS if v in os.environ]
        if found:
            node_rank = int(found[0][1])
        elif max_nodes > 1 and not elastic:
            raise ValueError("--no_ssh on several nodes needs --node_rank (or SLURM_NODEID, "
                             "OMPI_COMM_WORLD_RANK, PMI_RANK in the environment)")
        else:
            node_rank = 0
    if not elastic and node_rank >= max_nodes:
        raise ValueError(f"--node_rank {node_rank} is not below the number of nodes ({max_nodes})")
    host_slots = None
    if hosts and node_rank < len(hosts):
        host_slots = list(hosts.values())[node_rank]
    if opts.slots:
        host_slots = [int(s) for s in opts.slots.split(",")]
    if opts.num_procs is not None:
        nprocs = opts.num_procs
    elif host_slots is not None:
        nprocs = len(host_slots)
    else:
        accelerators, kind = count_accelerators()
        nprocs = resolve_num_procs(None, accelerators=accelerators, kind=kind)
    master_addr = opts.master_addr or (next(iter(hosts)) if hosts else None)
    if master_addr is None:
        if max_nodes > 1:
            raise ValueError("--no_ssh on several nodes needs --master_addr (the address of "
                             "node 0) or a --hostfile whose first host is node 0")
        master_addr = DEFAULT_MASTER_ADDR
    port = opts.master_port or DEFAULT_MASTER_PORT
    if node_rank == 0 and not elastic and not port_is_free(master_addr, port):
        raise ValueError(f"--master_port {port} is already in use on {master_addr} (node 0 "
                         "hosts the rendezvous there); free it or pick another port")
    label = opts.local_addr or socket.gethostname()
    return NodePlan(nprocs=nprocs, master_addr=master_addr, master_port=port,
                    min_nodes=min_nodes, max_nodes=max_nodes, node_rank=node_rank,
                    rdzv_backend="c10d" if elastic else "static", local_addr=opts.local_addr,
                    label=label if max_nodes > 1 or opts.force_multi else None,
                    slots=host_slots)


def _stop_with_parent() -> None:
    """Get SIGTERM when the parent (the ssh session) goes away, so no node outlives its job."""
    if sys.platform.startswith("linux"):
        import ctypes

        parent = os.getppid()
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        if parent == 1 or os.getppid() != parent:  # the session ended before prctl
            os.kill(os.getpid(), signal.SIGTERM)


@contextlib.contextmanager
def _environ(updates: dict[str, str]) -> Iterator[None]:
    """Set variables the agent passes on to workers; restore them afterwards."""
    saved = {k: os.environ.get(k) for k in updates}
    os.environ.update(updates)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def _pid_file(enabled: bool, say) -> Iterator[None]:
    if not enabled:
        yield
        return
    path = os.path.join(tempfile.gettempdir(), f"{os.getpid()}.shardwise")
    with open(path, "w") as f:
        f.write(str(os.getpid()))
    say(f"launcher pid {os.getpid()} saved to {path}")
    try:
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)


def run(opts: LaunchOptions, *, out: TextIO | None = None,
        hosts: dict[str, list[int]] | None = None, slots: list[int] | None = None) -> int:
    """Launch this node's workers, wait for them, return the exit code for ``shardwise run``.

    Without ``opts.no_ssh`` this is a single-node launch (``slots`` from ``--include`` on
    localhost, if any); with it, this node's share of the job described by ``hosts``.
    Raises ValueError (naming the flag) for bad options, before anything is started.
    """
    out = out or sys.stderr
    validate(opts)
    if opts.no_ssh:
        plan, note = plan_node(opts, hosts), None
    else:
        plan, note = plan_local(opts, slots=slots)
    tag = "[shardwise]" if plan.label is None else f"[shardwise {plan.label}]"

    def say(msg: str) -> None:
        print(f"{tag} {msg}", file=out, flush=True)

    if note:
        say(note)
    if opts.stop_with_parent:
        _stop_with_parent()
    env = {"PYTHONUNBUFFERED": os.environ.get("PYTHONUNBUFFERED", "1")}
    threads = os.environ.get("OMP_NUM_THREADS")
    if threads is None:
        threads = str(threads_per_rank(plan.nprocs, cores=usable_cores()))
        if not opts.bind_cores_to_rank:  # bind.py sets it from the cores each rank gets
            env["OMP_NUM_THREADS"] = threads
    if opts.comm_timeout is not None:
        env["SHARDWISE_COMM_TIMEOUT"] = str(opts.comm_timeout)
    if plan.rdzv_backend == "c10d":
        # Without this, every round reuses the agent's store, and the keys a failed attempt
        # left there (its ranks' gloo addresses) break the next attempt's rendezvous.
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    if plan.slots is not None and plan.slots != list(range(plan.nprocs)) and count_accelerators()[0]:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, plan.slots))
    program, args = worker_command(opts, bind_nprocs=plan.nprocs if opts.bind_cores_to_rank else None)
    shown = " ".join("--local_rank=<n>" if a == f"--local_rank={_LOCAL_RANK_MACRO}"
                     else shlex.quote(a.replace("$$", "$")) for a in [program, *args])
    program, args = guarded(program, args, launcher_pid=os.getpid())
    where = (f"node {plan.node_rank} of {plan.max_nodes}, " if plan.max_nodes > 1 else "")
    if plan.min_nodes != plan.max_nodes:
        where = f"{plan.min_nodes}-{plan.max_nodes} nodes (elastic), "
    say(f"starting {plan.nprocs} process(es), {where}rendezvous {plan.rdzv_backend} "
        f"{plan.master_addr}:{plan.master_port}, OMP_NUM_THREADS={threads}: {shown}")

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    log_dir = tempfile.mkdtemp(prefix="shardwise-run-")
    config = build_launch_config(plan, max_restarts=opts.max_restarts, log_dir=log_dir)
    interrupted = _stop_workers_with_sigterm_on_sigint()
    try:
        with _environ(env), _pid_file(opts.save_pid, say):
            elastic_launch(config, program)(*args)
        return 0
    except ChildFailedError as err:
        for line in describe_failure(err, log_dir=log_dir, nprocs=plan.nprocs).splitlines():
            say(line)
        _, first = err.get_first_failure()
        return exit_code_of(first.exitcode)
    except SignalException as err:
        got = signal.SIGINT if interrupted else err.sigval
        say(f"stopped by {got.name}; the workers were terminated")
        return 128 + int(got)
    finally:
        if interrupted is not None:
            signal.signal(signal.SIGINT, signal.default_int_handler)
        shutil.rmtree(log_dir, ignore_errors=True)


def _stop_workers_with_sigterm_on_sigint() -> list | None:
    """Make Ctrl-C stop the workers as fast as SIGTERM does.

    The elastic agent forwards the signal it got: a worker given SIGINT raises KeyboardInterrupt,
    which waits for the collective it is in, so a Ctrl-C took 2-5 s (until the agent's SIGKILL)
    where SIGTERM took 1 s. Here SIGINT is left out of the signals the agent handles (its
    ``signals_to_handle``, in build_launch_config) and turned
    into the agent's SIGTERM shutdown; the summary still says SIGINT. Returns a list that is
    non-empty once SIGINT came (None when not on the main thread, where nothing is changed).
    """
    import threading

    from torch.distributed.elastic.multiprocessing.api import SignalException

    if threading.current_thread() is not threading.main_thread():
        return None
    got: list = []

    def on_sigint(signum, frame):
        got.append(signum)
        raise SignalException(f"process {os.getpid()} got SIGINT", sigval=signal.SIGTERM)

    signal.signal(signal.SIGINT, on_sigint)
    return got


def exit_code_of(worker_exitcode: int) -> int:
    """Shell convention: a worker killed by signal S makes the launcher exit with 128+S."""
    if worker_exitcode < 0:
        return 128 - worker_exitcode
    return worker_exitcode or 1


def _how(exitcode: int) -> str:
    if exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit code {exitcode}"


def _stderr_tail(log_dir: str, local_rank: int, *, max_lines: int = 20) -> list[str]:
    """The end of a worker's stderr log, from its last traceback if there is one."""
    logs = glob.glob(os.path.join(log_dir, "*", "attempt_*", str(local_rank), "stderr.log"))
    if not logs:
        return []
    latest = max(logs, key=lambda p: int(p.split("attempt_")[-1].split(os.sep)[0]))
    with open(latest, errors="replace") as f:
        lines = f.read().rstrip().splitlines()
    # torch.distributed's excepthook already prefixes tracebacks with "[rank<n>]: "
    lines = [re.sub(r"^\[rank\d+\]: ?", "", line) for line in lines]
    starts = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent")]
    tail = lines[starts[-1]:] if starts else lines
    if len(tail) > max_lines:
        tail = ["...", *tail[-max_lines:]]
    return tail


def describe_failure(err, *, log_dir: str, nprocs: int) -> str:
    """A short, readable account of a ChildFailedError."""
    rank, first = err.get_first_failure()
    ended = "was " if first.exitcode < 0 else "failed with "  # "was killed by SIGKILL", "failed with exit code 1"
    lines = [f"rank {rank} (local rank {first.local_rank}, pid {first.pid}) {ended}"
             f"{_how(first.exitcode)}" + ("; the other ranks were stopped" if nprocs > 1 else "")]
    data = first.error_file_data or {}
    message = data.get("message") if isinstance(data, dict) else None
    if isinstance(message, dict) and message.get("message"):
        lines.append(f"error: {message['message']}")  # written by @record-decorated scripts
    tail = _stderr_tail(log_dir, first.local_rank)
    if tail:
        lines.append(f"end of rank {rank}'s stderr (its lines above start with '[rank{rank}]: '):")
        lines.extend("    " + line for line in tail)
    others = [f"rank {r} ({_how(f.exitcode)})" for r, f in sorted(err.failures.items()) if r != rank]
    if others:
        lines.append("also ended: " + ", ".join(others))
    return "\n".join(lines)
