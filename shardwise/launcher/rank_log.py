"""``--enable_each_rank_log DIR``: send this worker's stdout and stderr to its own file, then
become the worker.

    python -m shardwise.launcher.rank_log DIR STAMP -- PROGRAM ARGS...

The file is ``DIR/<STAMP>_rank<RANK>.log`` (DeepSpeed's naming), opened for appending; the
process then replaces itself with PROGRAM (``os.execv``), so the elastic agent watches the
real worker and a restarted attempt appends to the same file.
"""
from __future__ import annotations

import os
import shutil
import sys


def main(argv: list[str]) -> None:
    if len(argv) < 4 or argv[2] != "--":
        sys.exit("usage: python -m shardwise.launcher.rank_log DIR STAMP -- PROGRAM ARGS...")
    folder, stamp, program, args = argv[0], argv[1], argv[3], argv[4:]
    os.makedirs(folder, exist_ok=True)
    rank = os.environ.get("RANK", "0")
    fd = os.open(os.path.join(folder, f"{stamp}_rank{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    path = program if os.sep in program else (shutil.which(program) or program)
    os.execv(path, [program, *args])


if __name__ == "__main__":
    main(sys.argv[1:])
