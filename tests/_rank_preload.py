"""Imported once by the harness's fork server (tests/distributed.py) before it forks any rank.

Ranks forked from that server start with torch, shardwise and whatever else the test session had
imported already loaded, instead of importing them again in every rank (seconds of CPU per rank).
The module list comes in ``SHARDWISE_TEST_PRELOAD`` (one name a line); a module that fails to import
here is simply imported by the rank itself later.
"""
import os
import signal
import sys


def _die_with_parent() -> None:
    # The server's parent is the test process: when it goes, the server goes (and with it, through the
    # same signal, the ranks forked from it).
    if sys.platform.startswith("linux"):
        import ctypes

        parent = os.getppid()
        try:
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            return
        if os.getppid() != parent:
            os._exit(70)


def _preload() -> None:
    # tests/ is on the path only to find this module; the names below are installed modules, which
    # a helper in tests/ (distributed.py, models.py, ...) must not shadow.
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if p and os.path.abspath(p) != here]
    # One intra-op thread before torch starts, so no thread pool exists when the server forks.
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = "1"
    import torch
    import torch.distributed  # noqa: F401

    torch.set_num_threads(1)
    for name in os.environ.get("SHARDWISE_TEST_PRELOAD", "").splitlines():
        if name and name not in sys.modules:
            try:
                __import__(name)
            except BaseException:  # noqa: BLE001 - the rank imports it itself (and reports a real error there)
                pass
    # What was loaded here lives as long as the rank: out of the collector's sight (gc.freeze), a full
    # collection in a rank walks only the rank's own objects (as in a fresh interpreter) and does not
    # touch, and so copy, every page shared with the server.
    import gc

    gc.collect()
    gc.freeze()


_die_with_parent()
_preload()
