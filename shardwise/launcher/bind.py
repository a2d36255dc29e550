"""``--bind_cores_to_rank``: pin a worker to its share of the cores, then become the worker.

    python -m shardwise.launcher.bind LOCAL_RANK NPROCS -- PROGRAM ARGS...

The cores this process may use (or those of ``--bind_core_list``) are split into NPROCS equal, contiguous blocks (the
remainder goes to the first blocks); local rank r gets block r. With fewer cores than
processes, ranks share cores round-robin. ``OMP_NUM_THREADS`` is set to the block size
unless the user set it. Then the process replaces itself with PROGRAM (``os.execv``), so
the elastic agent watches the real worker.
"""
from __future__ import annotations

import os
import shutil
import sys


def core_block(cores: list[int], local_rank: int, nprocs: int) -> list[int]:
    if len(cores) < nprocs:
        return [cores[local_rank % len(cores)]]
    base, extra = divmod(len(cores), nprocs)
    start = local_rank * base + min(local_rank, extra)
    return cores[start:start + base + (1 if local_rank < extra else 0)]


def main(argv: list[str]) -> None:
    if len(argv) < 4 or argv[2] != "--":
        sys.exit("usage: python -m shardwise.launcher.bind LOCAL_RANK NPROCS -- PROGRAM ARGS...")
    local_rank, nprocs = int(argv[0]), int(argv[1])
    program, args = argv[3], argv[4:]
    cores = sorted(os.sched_getaffinity(0))
    listed = os.environ.get("SHARDWISE_BIND_CORE_LIST")  # --bind_core_list
    if listed:
        cores = [int(c) for c in listed.split(",")]
    mine = core_block(cores, local_rank, nprocs)
    os.sched_setaffinity(0, mine)
    os.environ.setdefault("OMP_NUM_THREADS", str(len(mine)))
    os.environ["SHARDWISE_BOUND_CORES"] = ",".join(map(str, mine))
    path = program if os.sep in program else (shutil.which(program) or program)
    os.execv(path, [program, *args])


if __name__ == "__main__":
    main(sys.argv[1:])
