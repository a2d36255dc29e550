"""The hang watchdog reports its own failures instead of silently turning hang reports off."""

from __future__ import annotations

import time

from shardwise.comm import ops, watchdog


class _BrokenStore:
    """A store whose polling raises a bug-like error (not a closed connection)."""

    def clone(self):
        return self

    def check(self, keys):
        raise ValueError("bad alarm key format")

    def compare_set(self, *args):
        raise KeyError("no such key")


def test_watchdog_thread_reports_its_own_failure(capsys, monkeypatch):
    monkeypatch.setattr(watchdog, "POLL_INTERVAL", 0.05)
    dog = watchdog.Watchdog(_BrokenStore(), rank=3, world_size=2, prefix="t")
    deadline = time.monotonic() + 5
    while dog._thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.02)
    dog.stop()
    err = capsys.readouterr().err
    assert "rank 3: the hang watchdog failed while answering an alarm" in err
    assert "ValueError: bad alarm key format" in err


def test_watchdog_alarm_reports_its_own_failure(capsys):
    dog = watchdog.Watchdog.__new__(watchdog.Watchdog)  # the alarm path alone, no thread
    dog._base, dog.rank, dog.world_size, dog._prefix = _BrokenStore(), 1, 2, "t"
    rec = ops.OpRecord("all_reduce", 0, "world", 2, [(4,)], "float32", 16, False)
    assert dog.alarm(rec, timed_out=True) == []
    err = capsys.readouterr().err
    assert "rank 1: the hang watchdog failed while collecting the other ranks' states" in err
    assert "KeyError" in err
