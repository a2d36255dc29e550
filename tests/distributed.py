"""Run a test body in N fresh processes joined by a gloo process group.

    from distributed import run_distributed, DistributedTestError

    def body(rank, world_size, scale):      # module level, so it pickles
        t = torch.full((2,), float(rank + 1)) * scale
        dist.all_reduce(t)
        return t.tolist()

    results = run_distributed(body, 2, args=(3.0,))   # [rank0_value, rank1_value]

What the harness guarantees:
* every rank gets MASTER_ADDR/MASTER_PORT (a free port), RANK, LOCAL_RANK, WORLD_SIZE,
  LOCAL_WORLD_SIZE and ``env``, one intra-op thread, and (unless ``init_process_group=False``)
  a default gloo group whose collective timeout is shorter than the harness ``timeout``;
* a rank that raises (or dies) makes the call raise :class:`DistributedTestError` at once,
  with that rank's number and full traceback; the other ranks are killed;
* a hang makes the call raise after ``timeout`` seconds, naming the stuck rank(s) with the
  Python stacks they were blocked in (dumped by ``faulthandler`` on SIGUSR1);
* child processes and temporary files are gone when the call returns, whatever happened.

A rank that returns early stays alive (idle) until every rank has returned, so a rank
blocked in a collective shows up as *stuck* rather than as a confusing "connection closed".

How ranks start: a fork server (``multiprocessing``'s ``forkserver``), started at the first call,
imports torch, shardwise and the other installed modules the test process has loaded by then
(tests/_rank_preload.py), then forks every rank from that state: a rank costs a fork, not a Python
start and a torch import (seconds of CPU each). The server never runs a torch op or a collective
before forking, so no thread pool or process-group state is inherited. Each rank gets the test
process's environment as it is at the call, plus ``env``; a module imported by the server has
already read the environment, so a call whose ``env`` must be seen by module imports passes
``fresh_interpreter=True`` (a plain ``spawn``: a new interpreter per rank).
``SHARDWISE_TEST_START_METHOD=spawn`` makes every call start fresh interpreters.

A call still costs a fork, a process-group rendezvous and the test module's own imports per rank:
put several cases in one body (a loop, or :func:`run_subtests`, which labels the failing case)
instead of one call per case.
"""
from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import pickle
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any, Callable, Iterable, Sequence

__all__ = ["run_distributed", "run_subtests", "DistributedTestError", "free_port"]

_STACK_DUMP_WAIT = 1.0  # seconds to wait for a signalled rank to write its stack
_PORT_RETRIES = 2  # re-spawns when another process grabbed our port before rank 0 bound it


class DistributedTestError(AssertionError):
    """A distributed test body failed or hung.

    ``rank`` is the first rank that failed (None for a pure hang), ``stuck_ranks`` the ranks
    still running at the timeout, ``details`` the traceback or stack text of each rank.
    Subclasses AssertionError so pytest reports it as a test failure, not an error.
    """

    def __init__(self, message: str, *, rank: int | None = None,
                 stuck_ranks: Sequence[int] = (), details: dict[int, str] | None = None):
        super().__init__(message)
        self.rank = rank
        self.stuck_ranks = list(stuck_ranks)
        self.details = dict(details or {})


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (another process may still take it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def run_subtests(body: Callable[..., Any], cases: Iterable[Any], *args: Any, **kwargs: Any) -> list:
    """Call ``body(case, *args, **kwargs)`` for every case inside one spawned group.

    Returns the list of results. A failure re-raises the original exception with a note
    naming the case, so the harness traceback says which sub-case broke.
    """
    results = []
    for case in cases:
        try:
            results.append(body(case, *args, **kwargs))
        except BaseException as exc:
            note = f"while running sub-case {case!r}"
            if hasattr(exc, "add_note"):
                exc.add_note(note)
                raise
            raise RuntimeError(note) from exc
    return results


# --------------------------------------------------------------------------- child side

_TORCH_AT_START: bool | None = None  # in a rank: whether torch was loaded before ``env`` was set

def _die_with_parent(parent_pid: int) -> None:
    """Make sure this rank goes away if the test process dies (e.g. pytest killed with SIGKILL).

    The rank's parent is the test process (spawn) or the fork server, which itself dies with the
    test process (tests/_rank_preload.py)."""
    parent = os.getppid()
    if sys.platform.startswith("linux"):
        import ctypes

        try:  # PR_SET_PDEATHSIG = 1: the kernel sends SIGKILL when the parent exits
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)
            if os.getppid() != parent:  # the parent died before prctl took effect
                os._exit(70)
            if parent != parent_pid:  # forked by the server: is the test process still there?
                os.kill(parent_pid, 0)
            return
        except ProcessLookupError:
            os._exit(70)
        except (OSError, AttributeError):
            pass

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(70)

    threading.Thread(target=watch, daemon=True).start()


def _child_main(rank: int, world_size: int, conn: Connection, fn_bytes: bytes,
                env: dict[str, str], stack_file: str, pg_timeout: float,
                init_pg: bool, parent_pid: int) -> None:
    global _TORCH_AT_START
    _TORCH_AT_START = "torch" in sys.modules  # False in a fresh interpreter: env comes first
    os.environ.clear()  # a forked rank inherits the server's environment: start from the caller's
    os.environ.update(env)
    _die_with_parent(parent_pid)
    stack_fh = open(stack_file, "w")
    faulthandler.register(signal.SIGUSR1, file=stack_fh, all_threads=True)
    phase = "setup"
    try:
        import datetime

        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        fn, args, kwargs = pickle.loads(fn_bytes)
        if init_pg:
            phase = "init"
            dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=pg_timeout))
        phase = "run"
        result = fn(rank, world_size, *args, **kwargs)
        phase = "report"
        conn.send(("ok", pickle.dumps(result)))
    except BaseException as exc:  # report everything, including SystemExit and KeyboardInterrupt
        timed_out = type(exc).__name__ == "DistBackendError" or "timed out" in str(exc).lower()
        try:
            conn.send(("error", {"phase": phase, "time": time.time(), "timed_out": timed_out,
                                 "summary": f"{type(exc).__name__}: {exc}",
                                 "traceback": traceback.format_exc()}))
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)  # skip teardown that could block on dead peers
    # Stay alive until every rank has returned, then tear down together.
    try:
        conn.recv()
    except EOFError:
        os._exit(0)
    if init_pg:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    # A rank forked by the server ends in os._exit, which skips what an interpreter runs at exit:
    # run it here (atexit hooks, weakref.finalize cleanups such as NVMe swap folders, pending
    # checkpoint writes), as a spawned rank's exit does.
    import atexit

    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()


# -------------------------------------------------------------------------- parent side

@dataclass
class _Rank:
    rank: int
    proc: Any
    conn: Connection
    stack_file: str
    result: Any = None
    done: bool = False
    error: dict | None = field(default=None)


def _recv(conn: Connection) -> Any:
    """The next message if one is waiting, else None (also at end of file)."""
    try:
        return conn.recv() if conn.poll() else None
    except (EOFError, OSError):
        return None


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except FileNotFoundError:
        return 0


def _send_stack_requests(ranks: list[_Rank]) -> dict[int, str]:
    """Signal every given live rank to dump its Python stacks; return what they wrote."""
    asked = []
    for r in ranks:
        if r.proc.is_alive():
            try:
                os.kill(r.proc.pid, signal.SIGUSR1)
                asked.append(r)
            except ProcessLookupError:
                pass
    stacks: dict[int, str] = {}
    deadline = time.monotonic() + _STACK_DUMP_WAIT
    last_sizes: dict[int, int] = {}
    while asked and time.monotonic() < deadline:
        time.sleep(0.1)
        sizes = {r.rank: _size(r.stack_file) for r in asked}
        if all(sizes.values()) and sizes == last_sizes:
            break  # every rank wrote something and nothing grew for 100 ms
        last_sizes = sizes
    for r in asked:
        try:
            with open(r.stack_file, errors="replace") as f:
                text = f.read().strip()
        except FileNotFoundError:
            text = ""
        stacks[r.rank] = text or "(no stack written: the rank did not respond)"
    return stacks


def _kill_all(ranks: list[_Rank]) -> None:
    for r in ranks:
        if r.proc.is_alive():
            r.proc.kill()
    for r in ranks:
        r.proc.join(timeout=10)
        r.conn.close()


def _indent(text: str) -> str:
    return "\n".join("    " + line for line in text.splitlines())


def _failure(ranks: list[_Rank], failed: list[_Rank], fn_name: str) -> DistributedTestError:
    failed.sort(key=lambda r: r.error["time"] if r.error else float("inf"))
    first = failed[0]
    others_running = [r for r in ranks if not r.done and r.error is None and r.proc.is_alive()]
    stacks = _send_stack_requests(others_running)
    details: dict[int, str] = {}
    lines = []
    for r in failed:
        if r.error is None:
            code = r.proc.exitcode
            how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
            details[r.rank] = f"rank {r.rank} died without reporting an exception ({how})"
            lines.append(details[r.rank])
        else:
            details[r.rank] = r.error["traceback"]
            what = "is stuck: a collective timed out" if r.error["timed_out"] else "raised"
            lines.append(f"rank {r.rank} {what} during {r.error['phase']}: {r.error['summary']}\n"
                         f"  traceback of rank {r.rank}:\n{_indent(r.error['traceback'])}")
    for rank, stack in sorted(stacks.items()):
        details[rank] = stack
        lines.append(f"rank {rank} was still running; its stack:\n{_indent(stack)}")
    stuck = sorted(r.rank for r in failed if r.error and r.error["timed_out"])
    what = "is stuck" if first.rank in stuck else "failed"
    head = f"{fn_name}: rank {first.rank} {what} (world size {len(ranks)})"
    finished = [str(r.rank) for r in ranks if r.done]
    if finished:
        head += f"; rank(s) {', '.join(finished)} had returned"
    return DistributedTestError(head + "\n" + "\n".join(lines), rank=first.rank,
                                stuck_ranks=stuck, details=details)


def _hang(ranks: list[_Rank], timeout: float, fn_name: str) -> DistributedTestError:
    stuck = [r for r in ranks if not r.done]
    stacks = _send_stack_requests(stuck)
    finished = [r.rank for r in ranks if r.done]
    lines = [f"{fn_name}: timed out after {timeout:g} s; stuck rank(s): "
             f"{', '.join(str(r.rank) for r in stuck)}"
             + (f"; rank(s) {', '.join(map(str, finished))} had returned" if finished else "")]
    for r in stuck:
        stack = stacks.get(r.rank, f"(process already exited, code {r.proc.exitcode})")
        lines.append(f"stack of stuck rank {r.rank}:\n{_indent(stack)}")
    return DistributedTestError("\n".join(lines), rank=None, stuck_ranks=[r.rank for r in stuck],
                                details={r.rank: stacks.get(r.rank, "") for r in stuck})


_PRELOAD_ENV = "SHARDWISE_TEST_PRELOAD"
_START_METHOD_ENV = "SHARDWISE_TEST_START_METHOD"
_TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
_SKIP_ROOTS = ("__main__", "__mp_main__", "_pytest", "pytest", "pluggy", "py", "deepspeed", "conftest")
_preload: list[str] | None = None


def _preload_names() -> list[str]:
    """The installed modules (site-packages, the standard library, shardwise) this process has loaded:
    what the fork server imports before forking ranks. Test modules and the deepspeed package (whose
    real and compat copies tests swap) are left to the ranks."""
    import sysconfig

    roots = {sysconfig.get_paths()[k] for k in ("purelib", "platlib", "stdlib", "platstdlib")}
    shardwise = sys.modules.get("shardwise")
    if shardwise is not None and getattr(shardwise, "__file__", None):
        roots.add(os.path.dirname(shardwise.__file__))
    roots_t = tuple(os.path.join(r, "") for r in roots)
    names = []
    for name, mod in list(sys.modules.items()):
        if mod is None or name.partition(".")[0] in _SKIP_ROOTS:
            continue
        origin = getattr(mod, "__file__", None)
        if isinstance(origin, str) and origin.startswith(roots_t) and not origin.startswith(_TESTS_DIR):
            names.append(name)
    return sorted(names)


def _context(fresh: bool) -> Any:
    """The multiprocessing context ranks start from (see the module docstring)."""
    method = "spawn" if fresh else os.environ.get(_START_METHOD_ENV, "forkserver")
    if method != "forkserver":
        return mp.get_context(method)
    global _preload
    from multiprocessing import forkserver

    if _preload is None:
        _preload = _preload_names()
        forkserver.set_forkserver_preload(["_rank_preload"])
    # The server takes this process's environment when it starts (here, or again if it died):
    # where to find _rank_preload and what to import.
    saved = {k: os.environ.get(k) for k in ("PYTHONPATH", _PRELOAD_ENV)}
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_TESTS_DIR, saved["PYTHONPATH"]) if p)
    os.environ[_PRELOAD_ENV] = "\n".join(_preload)
    try:
        forkserver.ensure_running()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return mp.get_context("forkserver")


def _run_once(fn_bytes: bytes, fn_name: str, world_size: int, *, timeout: float,
              env: dict[str, str], init_pg: bool, tmpdir: str,
              fresh: bool) -> tuple[list[Any] | None, Exception | None]:
    ctx = _context(fresh)
    port = free_port()
    pg_timeout = max(1.0, 0.8 * timeout)
    ranks: list[_Rank] = []
    try:
        for rank in range(world_size):
            rank_env = {**os.environ, "OMP_NUM_THREADS": "1", **env, "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": str(port), "RANK": str(rank), "LOCAL_RANK": str(rank),
                        "WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE": str(world_size)}
            parent_end, child_end = ctx.Pipe(duplex=True)
            stack_file = os.path.join(tmpdir, f"stack-rank{rank}.txt")
            proc = ctx.Process(target=_child_main, name=f"{fn_name}-rank{rank}", daemon=True,
                               args=(rank, world_size, child_end, fn_bytes, rank_env, stack_file,
                                     pg_timeout, init_pg, os.getpid()))
            proc.start()
            child_end.close()
            ranks.append(_Rank(rank, proc, parent_end, stack_file))
        deadline = time.monotonic() + timeout
        while not all(r.done for r in ranks):
            waiting = {}
            for r in ranks:
                if not r.done:
                    waiting[r.conn] = r
                    waiting[r.proc.sentinel] = r
            left = deadline - time.monotonic()
            ready = wait(list(waiting), timeout=max(0.0, left)) if left > 0 else []
            if not ready:
                return None, _hang(ranks, timeout, fn_name)
            failed: list[_Rank] = []
            for obj in ready:
                r = waiting[obj]
                if r.done or r in failed:
                    continue
                msg = _recv(r.conn)
                if msg is not None and msg[0] == "ok":
                    r.result, r.done = pickle.loads(msg[1]), True
                    continue
                if msg is not None:
                    r.error = msg[1]
                elif r.proc.is_alive():
                    continue  # connection readiness was EOF racing the exit; sentinel follows
                failed.append(r)
            if failed:
                # Pick up errors other ranks reported in the same instant, for ordering.
                for r in ranks:
                    if not r.done and r not in failed:
                        msg = _recv(r.conn)
                        if msg is not None and msg[0] == "error":
                            r.error = msg[1]
                            failed.append(r)
                return None, _failure(ranks, failed, fn_name)
        for r in ranks:
            r.conn.send("exit")
        for r in ranks:
            r.proc.join(timeout=10)
        return [r.result for r in ranks], None
    finally:
        _kill_all(ranks)


def run_distributed(fn: Callable[..., Any], world_size: int, *, args: Sequence[Any] = (),
                    kwargs: dict[str, Any] | None = None, timeout: float = 120.0,
                    env: dict[str, str] | None = None,
                    init_process_group: bool = True, fresh_interpreter: bool = False) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` spawned ranks.

    Returns the per-rank return values in rank order. ``fn``, ``args``, ``kwargs`` and the
    return values must pickle (``fn`` must be a module-level function). ``env`` entries are
    set in every rank before ``fn`` runs, on top of this process's environment; with
    ``fresh_interpreter=True`` each rank is a new interpreter that sees them before it imports
    anything (torch included). ``init_process_group=False`` leaves the default group to ``fn``
    (for testing code that initialises it itself).
    Raises :class:`DistributedTestError` on a failure or after ``timeout`` seconds.
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if timeout <= 0:
        raise ValueError(f"timeout must be positive seconds, got {timeout!r}")
    fn_name = getattr(fn, "__qualname__", repr(fn))
    fn_bytes = pickle.dumps((fn, tuple(args), dict(kwargs or {})))
    env = {str(k): str(v) for k, v in (env or {}).items()}
    tmpdir = tempfile.mkdtemp(prefix="shardwise-dist-")
    try:
        for attempt in range(_PORT_RETRIES + 1):
            results, error = _run_once(fn_bytes, fn_name, world_size, timeout=timeout, env=env,
                                       init_pg=init_process_group, tmpdir=tmpdir,
                                       fresh=fresh_interpreter)
            if error is None:
                return results  # type: ignore[return-value]
            text = str(error).lower()
            port_clash = "during init" in text and ("address already in use" in text
                                                    or "eaddrinuse" in text)
            if not port_clash or attempt == _PORT_RETRIES:
                raise error
        raise AssertionError("unreachable")
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)
