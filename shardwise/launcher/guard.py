"""Make a worker die with the process that launched it, then become the worker.

    python .../shardwise/launcher/guard.py LAUNCHER_PID -- PROGRAM ARGS...

torch's elastic agent starts each worker in a session of its own, so when the launcher (the
agent) is killed with SIGKILL nothing stops the workers: they keep training and writing into
the same ``save_dir`` as the job that is restarted next. This wrapper asks Linux to send the
worker SIGKILL when its parent dies (``prctl(PR_SET_PDEATHSIG)``; the setting survives
``execv``), checks that the parent is still ``LAUNCHER_PID`` (it may have died before the
``prctl``), and replaces itself with PROGRAM, so the agent watches the real worker.

It is run as a file, not ``-m``, so that starting it imports nothing but the standard library
(``import shardwise`` would import torch, over a second per worker). On other systems it only
execs PROGRAM.
"""
from __future__ import annotations

import os
import shutil
import signal
import sys

PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGKILL, *, parent: int | None = None) -> bool:
    """Have the kernel send ``sig`` to this process when its parent exits (Linux only).

    With ``parent``, a parent that is already gone (this process was re-parented) sends
    ``sig`` at once. Returns whether the kernel took the request."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        return False
    if parent is not None and os.getppid() != parent:
        os.kill(os.getpid(), sig)
    return True


def main(argv: list[str]) -> None:
    if len(argv) < 3 or argv[1] != "--":
        sys.exit("usage: python guard.py LAUNCHER_PID -- PROGRAM ARGS...")
    parent, program, args = int(argv[0]), argv[2], argv[3:]
    die_with_parent(signal.SIGKILL, parent=parent)
    path = program if os.sep in program else (shutil.which(program) or program)
    os.execv(path, [program, *args])


if __name__ == "__main__":
    main(sys.argv[1:])
