"""Start N local worker processes through torch's elastic agent and report how they ended.

The agent (``torch.distributed.launcher.api.elastic_launch``) owns the processes: it sets
RANK/LOCAL_RANK/WORLD_SIZE/LOCAL_WORLD_SIZE/MASTER_ADDR/MASTER_PORT, hosts the
rendezvous store, streams each worker's output with a ``[rank<n>]: `` prefix, stops the
whole group when one worker fails and restarts it up to ``max_restarts`` times. This
module only turns :class:`LaunchOptions` into the agent's configuration and its outcome
into an exit code and a readable summary.
"""
from __future__ import annotations

import contextlib
import glob
import os
import re
import shlex
import shutil
import signal
import sys
import tempfile
import uuid
from typing import Iterator, TextIO

from .options import (LaunchOptions, count_accelerators, resolve_master_port, resolve_num_procs,
                      threads_per_rank, usable_cores, validate)

LOG_LINE_PREFIX = "[rank${rank}]: "
MONITOR_INTERVAL = 0.1  # seconds between the agent's health checks of the workers
SHUTDOWN_TIMEOUT = 5  # seconds the agent gives workers after SIGTERM before SIGKILL
_LOCAL_RANK_MACRO = "${local_rank}"  # replaced per worker by the agent


def worker_command(opts: LaunchOptions) -> tuple[str, list[str]]:
    """The program each worker runs and its arguments (with the local-rank macro)."""
    # The agent expands ${...} templates in every argument; double each '$' of the user's
    # arguments so they reach the script unchanged.
    user_args = [a.replace("$", "$$") for a in opts.script_args]
    local_rank = [] if opts.no_local_rank else [f"--local_rank={_LOCAL_RANK_MACRO}"]
    if opts.no_python:
        program = shutil.which(opts.script) or opts.script
        return program, [*local_rank, *user_args]
    python = os.environ.get("PYTHON_EXEC", sys.executable)
    target = ["-m", opts.script] if opts.module else [opts.script]
    return python, ["-u", *target, *local_rank, *user_args]


def build_launch_config(*, nprocs: int, master_addr: str, master_port: int, max_restarts: int,
                        log_dir: str):
    """A single-node LaunchConfig: static rendezvous on master_addr:master_port."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.launcher.api import LaunchConfig

    shutdown = int(os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", SHUTDOWN_TIMEOUT))
    return LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nprocs,
        run_id=f"shardwise-{uuid.uuid4().hex[:12]}",
        rdzv_backend="static", rdzv_endpoint=f"{master_addr}:{master_port}",
        rdzv_configs={"rank": 0},
        max_restarts=max_restarts, monitor_interval=MONITOR_INTERVAL,
        # tee = write each stream to a log file and echo it, prefixed, to our console
        logs_specs=DefaultLogsSpecs(log_dir=log_dir, tee=Std.ALL),
        log_line_prefix_template=LOG_LINE_PREFIX,
        shutdown_timeout=shutdown,
    )


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


def run(opts: LaunchOptions, *, out: TextIO | None = None) -> int:
    """Launch the workers, wait for them, return the process exit code for ``shardwise run``.

    Raises ValueError (naming the flag) for bad options, before anything is started.
    """
    out = out or sys.stderr

    def say(msg: str) -> None:
        print(f"[shardwise] {msg}", file=out, flush=True)

    validate(opts)
    port, note = resolve_master_port(opts)
    accelerators, kind = count_accelerators()
    nprocs = resolve_num_procs(opts.num_procs, accelerators=accelerators, kind=kind)
    if note:
        say(note)

    env = {"PYTHONUNBUFFERED": os.environ.get("PYTHONUNBUFFERED", "1")}
    threads = os.environ.get("OMP_NUM_THREADS")
    if threads is None:
        threads = str(threads_per_rank(nprocs, cores=usable_cores()))
        env["OMP_NUM_THREADS"] = threads
    program, args = worker_command(opts)
    shown = " ".join("--local_rank=<n>" if a == f"--local_rank={_LOCAL_RANK_MACRO}"
                     else shlex.quote(a.replace("$$", "$")) for a in [program, *args])
    say(f"starting {nprocs} process(es) on {kind if accelerators else 'cpu'}, rendezvous "
        f"{opts.master_addr}:{port}, OMP_NUM_THREADS={threads}: {shown}")

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    log_dir = tempfile.mkdtemp(prefix="shardwise-run-")
    config = build_launch_config(nprocs=nprocs, master_addr=opts.master_addr, master_port=port,
                                 max_restarts=opts.max_restarts, log_dir=log_dir)
    try:
        with _environ(env), _pid_file(opts.save_pid, say):
            elastic_launch(config, program)(*args)
        return 0
    except ChildFailedError as err:
        for line in describe_failure(err, log_dir=log_dir, nprocs=nprocs).splitlines():
            say(line)
        _, first = err.get_first_failure()
        return exit_code_of(first.exitcode)
    except SignalException as err:
        say(f"stopped by {err.sigval.name}; the workers were terminated")
        return 128 + int(err.sigval)
    finally:
        shutil.rmtree(log_dir, ignore_errors=True)


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
    lines = [f"rank {rank} (local rank {first.local_rank}, pid {first.pid}) failed with "
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
