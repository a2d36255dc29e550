"""Bookkeeping around every collective: what it is, its sequence number, whether it is done.

Each wrapper in ``comm.py`` calls :func:`run` with the backend function and its arguments. It
gives the collective a record (op name, group, tensor shapes, dtype, bytes, a per-group sequence
number), keeps the record in the in-flight table until the op completes, hands completed records to
the comms logger, and turns a backend failure into a :class:`CollectiveError` that says which collective it was,
on this rank and, through the watchdog, on every other rank.

All ranks of a group issue the same collectives in the same order, so the sequence
numbers agree across ranks: "all_reduce #57 on world" names the same call everywhere.
"""
from __future__ import annotations

import datetime
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

__all__ = ["CollectiveError", "CollectiveTimeoutError", "OpRecord", "TrackedWork", "run",
           "in_flight", "last_completed", "describe_group", "reset"]


class CollectiveError(RuntimeError):
    """A collective failed; the message names it (op, group, sizes, sequence number)."""

    def __init__(self, message: str, *, record: "OpRecord", ranks: list[dict] | None = None):
        super().__init__(message)
        self.record = record
        self.ranks = ranks or []  # what every rank that answered was doing (watchdog)


class CollectiveTimeoutError(CollectiveError):
    """A collective did not complete within the process group's timeout."""


CollectiveError.__module__ = CollectiveTimeoutError.__module__ = "shardwise.comm"


@dataclass
class OpRecord:
    name: str
    seq: int
    group: str  # "world" or "ranks [0, 2]"
    group_size: int
    shapes: list[tuple[int, ...]]
    dtype: str
    nbytes: int  # message size used by the comms logger (see docs/comms.md)
    async_op: bool
    caller: str | None = None
    start: float = field(default_factory=time.perf_counter)
    end: float | None = None

    def describe(self) -> str:
        shapes = ", ".join(f"{self.dtype}[{'x'.join(map(str, s)) or '1'}]" for s in self.shapes)
        size = f", {human_bytes(self.nbytes)}" if self.nbytes else ""
        return (f"{self.name} #{self.seq} on {self.group} ({self.group_size} ranks)"
                + (f": {shapes}{size}" if shapes else ""))

    def short(self) -> str:
        return f"{self.name} #{self.seq} on {self.group}"


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


# ------------------------------------------------------------------------ shared state
_lock = threading.Lock()
_seq: dict[int, int] = {}  # id(process group) -> last sequence number issued on it
_group_names: dict[int, tuple[object, tuple[str, int]]] = {}  # id -> (group, name)
_in_flight: dict[int, OpRecord] = {}  # id(record) -> record
_last: list[OpRecord | None] = [None]
# Set by comm.configure(): the comms logger (or None) and hooks run around each op.
logger: Any = None
on_first_op: Callable[[], None] | None = None
on_failure: Callable[[OpRecord, bool], list[dict]] | None = None
timeout: datetime.timedelta | None = None  # the process groups' collective timeout


def reset() -> None:
    """Forget sequence numbers and in-flight ops (a new process group starts at #1)."""
    with _lock:
        _seq.clear()
        _group_names.clear()
        _in_flight.clear()
        _last[0] = None


def describe_group(group) -> tuple[str, int]:
    """("world", size) for the default group, else ("ranks [..]", size)."""
    if not dist.is_initialized():
        return "world", 1
    pg = group if group is not None else dist.group.WORLD
    key = id(pg)
    held = _group_names.get(key)
    if held is None or held[0] is not pg:  # (a destroyed group's id may be reused by a new one)
        if pg is dist.group.WORLD:
            named = ("world", dist.get_world_size())
        else:
            ranks = dist.get_process_group_ranks(pg)
            named = (f"ranks {_ranges(ranks)}", len(ranks))
        held = _group_names[key] = (pg, named)
    return held[1]


def _ranges(ranks: Sequence[int]) -> str:
    out, run = [], []
    for r in sorted(ranks):
        if run and r == run[-1] + 1:
            run.append(r)
            continue
        if run:
            out.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
        run = [r]
    if run:
        out.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
    return "[" + ",".join(out) + "]"


def in_flight() -> list[OpRecord]:
    """Collectives this rank has started and not yet seen complete, oldest first."""
    with _lock:
        return sorted(_in_flight.values(), key=lambda r: r.start)


def last_completed() -> OpRecord | None:
    return _last[0]


def _begin(name: str, group, tensors: Sequence[torch.Tensor], nbytes: int,
           async_op: bool) -> OpRecord:
    if on_first_op is not None:
        on_first_op()
    group_name, size = describe_group(group)
    key = id(group if group is not None else dist.group.WORLD)
    caller = None
    if logger is not None and logger.debug:
        caller = sys._getframe(3).f_code.co_name  # _begin <- run <- wrapper <- caller
    with _lock:
        seq = _seq.get(key, 0) + 1
        _seq[key] = seq
        rec = OpRecord(name, seq, group_name, size, [tuple(t.shape) for t in tensors],
                       str(tensors[0].dtype).replace("torch.", "") if tensors else "",
                       nbytes, async_op, caller)
        _in_flight[id(rec)] = rec
    return rec


def _finish(rec: OpRecord) -> None:
    with _lock:
        if _in_flight.pop(id(rec), None) is None:
            return  # already finished (wait() called twice)
        if rec.end is None:
            rec.end = time.perf_counter()
        _last[0] = rec
    if logger is not None and logger.wants(rec.name):
        logger.record(rec)


def _failure(rec: OpRecord, exc: BaseException) -> CollectiveError:
    text = str(exc).strip()
    timed_out = "timed out" in text.lower() or "timeout" in text.lower()
    elapsed = time.perf_counter() - rec.start
    ranks = on_failure(rec, timed_out) if on_failure is not None else []
    rank = dist.get_rank() if dist.is_initialized() else 0
    what = "did not complete (timed out)" if timed_out else "failed"
    lines = [f"rank {rank}: {rec.describe()} {what} after {elapsed:.1f} s"]
    limit = timeout
    if timed_out and limit is not None:
        lines[0] += f" (collective timeout {limit.total_seconds():g} s)"
    if ranks:
        lines.append("where each rank was:")
        world = dist.get_world_size() if dist.is_initialized() else None
        lines.extend("  " + line for line in format_states(ranks, world))
    lines.append(f"backend error: {text.splitlines()[0] if text else type(exc).__name__}")
    with _lock:
        _in_flight.pop(id(rec), None)
    cls = CollectiveTimeoutError if timed_out else CollectiveError
    return cls("\n".join(lines), record=rec, ranks=ranks)


def _on_device(tensors: Sequence[torch.Tensor]) -> bool:
    return any(t.device.type != "cpu" for t in tensors)


class TrackedWork:
    """The handle of an asynchronous collective; ``wait()`` reports failures by name."""

    __slots__ = ("_work", "record")

    def __init__(self, work, record: OpRecord) -> None:
        self._work = work
        self.record = record

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        try:
            ok = self._work.wait() if timeout is None else self._work.wait(timeout)
        except RuntimeError as exc:
            raise _failure(self.record, exc) from exc
        _finish(self.record)
        return ok

    def __getattr__(self, name: str):
        return getattr(self._work, name)


_NO_KWARGS: dict = {}


def run(name: str, fn: Callable[..., Any], args: tuple = (), kwargs: dict = _NO_KWARGS, *, group,
        tensors: Sequence[torch.Tensor], nbytes: int, async_op: bool = False):
    """Issue one collective, ``fn(*args, **kwargs)``, with its record; see the module docstring.

    ``fn`` is the backend's function (``torch.distributed``'s, or a ``direct`` exchange) and the caller
    gives its arguments up front, so this module calls nothing back in the caller's."""
    rec = _begin(name, group, tensors, nbytes, async_op)
    try:
        work = fn(*args, **kwargs)
    except RuntimeError as exc:
        raise _failure(rec, exc) from exc
    except Exception:  # refused before anything was sent (bad sizes): not in flight
        with _lock:
            _in_flight.pop(id(rec), None)
        raise
    timing = logger is not None and logger.wants(name)
    if async_op:
        if timing:
            if _on_device(tensors):  # device work is timed like DeepSpeed does: synchronously
                work.wait()
                torch.accelerator.synchronize()
                rec.end = time.perf_counter()
            else:  # gloo completes the future on its own thread: the true end time
                work.get_future().add_done_callback(lambda _f: _stamp(rec))
        return TrackedWork(work, rec)
    if timing and _on_device(tensors):
        torch.accelerator.synchronize()
    _finish(rec)
    return work


def _stamp(rec: OpRecord) -> None:
    if rec.end is None:
        rec.end = time.perf_counter()


# -- what every rank was doing (snapshots the watchdog collects) ------------------------
def summarize_state(state: dict) -> tuple[str, str]:
    """(what the rank was doing, without times: for grouping ranks; the same with times)."""
    if state["in_flight"]:
        oldest = state["in_flight"][0]
        return f"in {oldest['op']}", f"in {oldest['op']} for {oldest['for']:.1f} s"
    last = state.get("last")
    tail = f" (last completed: {last['op']})" if last else " (none completed yet)"
    if state.get("stack"):
        tail += f"; main thread at {state['stack'][-1].split(': ', 1)[0]}"
    since = f" for {last['ago']:.1f} s" if last else ""
    return "not in a collective" + tail, "not in a collective" + since + tail


def format_states(states: list[dict], world_size: int | None = None) -> list[str]:
    """One line per distinct state, ranks with the same state grouped together."""
    groups: dict[str, list[tuple[int, str]]] = {}
    for s in states:
        key, text = summarize_state(s)
        groups.setdefault(key, []).append((s["rank"], text))
    lines = []
    for members in sorted(groups.values(), key=lambda m: m[0][0]):
        ranks = _ranges([r for r, _ in members])[1:-1]
        word = "rank" if len(members) == 1 else "ranks"
        lines.append(f"{word} {ranks}: {members[0][1]}")
    if world_size is not None:
        missing = sorted(set(range(world_size)) - {s["rank"] for s in states})
        if missing:
            lines.append(f"rank(s) {_ranges(missing)[1:-1]}: no answer (exited, or "
                         f"blocked outside Python)")
    return lines
