"""When a collective fails on one rank, find out where every rank of the job is.

A rank that stops calling collectives is, by definition, not in our code when the
others time out, so it cannot raise anything itself. Each rank therefore runs a small
daemon thread that polls one key of the process group's store (on its own connection,
cloned from the default store) every second. A rank whose collective fails sets that
key; every rank's thread then posts a snapshot of its state (collectives in flight, the
last one completed, where its main thread is) and prints it if the rank is not blocked
in that same collective. The failing rank waits briefly for the snapshots and puts them
in its exception message, so a hang reads as "rank 2 never reached all_reduce #57".
"""
from __future__ import annotations

import atexit
import json
import os
import socket
import sys
import threading
import time
import traceback

from shardwise.comm import ops

POLL_INTERVAL = 1.0  # seconds between checks of the alarm key
ANSWER_WAIT = 2 * POLL_INTERVAL + 1.0  # how long a failing rank waits for the others' snapshots
_STACK_FRAMES = 4  # frames of a rank's main thread shown when it is not in a collective


def snapshot(rank: int) -> dict:
    """This rank's state, JSON-able: in-flight collectives, the last completed, main stack."""
    now = time.perf_counter()
    state: dict = {"rank": rank, "host": socket.gethostname(), "pid": os.getpid(),
                   "in_flight": [{"op": r.short(), "for": round(now - r.start, 1)}
                                 for r in ops.in_flight()]}
    last = ops.last_completed()
    if last is not None:
        state["last"] = {"op": last.short(), "ago": round(now - (last.end or now), 1)}
    frame = sys._current_frames().get(threading.main_thread().ident)
    if frame is not None and not state["in_flight"]:
        stack = traceback.extract_stack(frame)[-_STACK_FRAMES:]
        state["stack"] = [f"{f.filename}:{f.lineno} in {f.name}: {(f.line or '').strip()}"
                          for f in stack]
    return state


class Watchdog:
    def __init__(self, store, *, rank: int, world_size: int, prefix: str) -> None:
        self._base = store
        self.rank, self.world_size = rank, world_size
        self._prefix = prefix
        self._stop = threading.Event()
        self._posted = False
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="shardwise-comm-watchdog",
                                        daemon=True)
        self._poll_store = store.clone()
        self._thread.start()
        atexit.register(self.stop)

    def _key(self, name: str) -> str:
        return f"{self._prefix}/{name}"

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=2 * POLL_INTERVAL)

    # -- the thread -------------------------------------------------------------------
    def _loop(self) -> None:
        alarm_key = self._key("alarm")
        while not self._stop.wait(POLL_INTERVAL):
            try:
                if not self._poll_store.check([alarm_key]):
                    continue
                alarm = json.loads(self._poll_store.get(alarm_key))
                self._answer(self._poll_store, alarm)
            except Exception as exc:  # noqa: BLE001 - reported, not swallowed
                if not self._stop.is_set() and not _store_gone(exc):
                    _report_own_failure(self.rank, "answering an alarm", exc)
            return

    def _answer(self, store, alarm: dict) -> None:
        state = snapshot(self.rank)
        self._post(store, state)
        blocked_there = state["in_flight"] and state["in_flight"][0]["op"] == alarm["op"]
        if alarm["rank"] != self.rank and not blocked_there:
            _, text = ops.summarize_state(state)
            lines = [f"[shardwise] rank {self.rank} ({state['host']}, pid {state['pid']}): "
                     f"rank {alarm['rank']} reported that {alarm['op']} {alarm['what']}; "
                     f"this rank is {text}"]
            lines += [f"[shardwise]     {line}" for line in state.get("stack", [])]
            print("\n".join(lines), file=sys.stderr, flush=True)

    def _post(self, store, state: dict) -> None:
        with self._lock:
            store.set(self._key(f"state/{self.rank}"), json.dumps(state))
            if not self._posted:
                self._posted = True
                store.add(self._key("answers"), 1)

    # -- called by the failing rank ---------------------------------------------------
    def alarm(self, rec: ops.OpRecord, timed_out: bool) -> list[dict]:
        """Raise the alarm for ``rec`` and return the snapshots of every rank that answers."""
        try:
            store = self._base.clone()
            what = "timed out" if timed_out else "failed"
            payload = json.dumps({"rank": self.rank, "op": rec.short(), "what": what})
            store.compare_set(self._key("alarm"), "", payload)  # the first rank's alarm stays
            self._post(store, snapshot(self.rank))
            deadline = time.monotonic() + ANSWER_WAIT
            while time.monotonic() < deadline:
                if store.add(self._key("answers"), 0) >= self.world_size:
                    break
                time.sleep(0.1)
            states = []
            for r in range(self.world_size):
                key = self._key(f"state/{r}")
                if store.check([key]):
                    states.append(json.loads(store.get(key)))
            return states
        except Exception as exc:  # noqa: BLE001 - the report then names this rank only
            _report_own_failure(self.rank, "collecting the other ranks' states", exc)
            return []


def _store_gone(exc: BaseException) -> bool:
    """The rendezvous store closed under us: the job is ending, nothing to report."""
    text = str(exc).lower()
    return isinstance(exc, (ConnectionError, EOFError)) or any(
        w in text for w in ("connection reset", "broken pipe", "connection refused", "connection closed",
                            "socket", "recv", "send"))


def _report_own_failure(rank: int, doing: str, exc: BaseException) -> None:
    """The watchdog's own failure, printed once (it runs in a thread: raising would be lost)."""
    print(f"[shardwise] rank {rank}: the hang watchdog failed while {doing}, so hang reports from this "
          f"rank are incomplete: {type(exc).__name__}: {exc}\n"
          + "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
          file=sys.stderr, flush=True)
