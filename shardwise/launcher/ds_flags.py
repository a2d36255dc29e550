"""The flags of DeepSpeed's ``deepspeed`` launcher that ``shardwise run`` takes on top of its own.

``shardwise run`` accepts every flag of ``deepspeed`` (0.19): the ones with the same meaning are
declared in ``options.py``; the rest are here, with what each becomes:

* ``--launcher openmpi|mpich|impi|mvapich`` -> the ``mpi`` runner (``mpirun``; ``--launcher_args``
  passes anything the MPI flavour needs);
* ``--no_ssh_check`` -> skip the pre-launch host checks (``--skip_doctor``);
* ``--enable_each_rank_log DIR`` -> each rank's stdout and stderr go to
  ``DIR/<launch time>_rank<RANK>.log`` instead of the console;
* ``--bind_core_list 0,2-5`` -> the cores ``--bind_cores_to_rank`` splits between local ranks
  (and it turns binding on);
* ``--venv_script PATH`` -> every worker runs after ``source PATH`` (a virtualenv's activate);
* ``--autotuning tune|run`` -> ``shardwise autotune`` with the same flags; ``run`` then launches
  the script with the best config found (``shardwise.autotuning.tune_then_run``: the tool built on
  the launcher calls into it, never the other way);
* ``--log_level LEVEL`` / ``-q`` -> the launcher's own log level.

No ``deepspeed`` console script is installed: it would shadow a real DeepSpeed.
"""
from __future__ import annotations

import argparse
import logging
import os
import time

MPI_FLAVOURS = ("openmpi", "mpich", "impi", "mvapich")
LAUNCHERS = ("ssh", "pdsh", "slurm", "mpi", *MPI_FLAVOURS)
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
CORE_LIST_ENV = "SHARDWISE_BIND_CORE_LIST"


def add_deepspeed_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("DeepSpeed launcher flags")
    g.add_argument("--no_ssh_check", "--no-ssh-check", action="store_true",
                   help="do not check the hosts over ssh before a multi-node launch (= --skip_doctor)")
    g.add_argument("--enable_each_rank_log", "--enable-each-rank-log", default=None, metavar="DIR",
                   help="write each rank's stdout/stderr to DIR/<time>_rank<RANK>.log instead of the console")
    g.add_argument("--bind_core_list", "--bind-core-list", default=None, metavar="CORES",
                   help="cores to split between local ranks, e.g. 0,2-5 (implies --bind_cores_to_rank)")
    g.add_argument("--venv_script", "--venv-script", default=None, metavar="PATH",
                   help="shell script every worker sources first (e.g. a virtualenv's bin/activate)")
    g.add_argument("--autotuning", default="", choices=["", "tune", "run"],
                   help="tune: run 'shardwise autotune' with these flags; run: tune, then train with the best config")
    g.add_argument("--log_level", "--log-level", default="info", type=str.lower, choices=LOG_LEVELS,
                   help="the launcher's log level (default %(default)s)")
    g.add_argument("-q", "--quiet", action="store_true", help="the launcher logs errors only (= --log_level error)")


def normalize_launcher(name: str) -> str:
    """DeepSpeed's launcher names (any case) -> the runner that starts them."""
    low = str(name).lower()
    if low in MPI_FLAVOURS:
        return "mpi"
    return low


def parse_core_list(spec: str) -> list[int]:
    """``"0,2-5,8"`` -> ``[0, 2, 3, 4, 5, 8]``; ValueError naming --bind_core_list."""
    cores: list[int] = []
    try:
        for part in spec.split(","):
            lo, _, hi = part.strip().partition("-")
            if int(hi or lo) < int(lo):  # "6-2": a range written backwards
                raise ValueError
            cores.extend(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        raise ValueError(f"--bind_core_list {spec!r}: expected core numbers and ranges, e.g. 0,2-5") from None
    if not cores or len(set(cores)) != len(cores) or min(cores) < 0:
        raise ValueError(f"--bind_core_list {spec!r}: expected distinct non-negative core numbers")
    return cores


def apply_log_level(ns: argparse.Namespace) -> None:
    level = "error" if getattr(ns, "quiet", False) else getattr(ns, "log_level", "info")
    logging.getLogger("shardwise").setLevel(getattr(logging, level.upper()))


def wrap_worker(opts, program: str, args: list[str]) -> tuple[str, list[str]]:
    """The worker command with the per-rank log file and the venv script applied (if asked)."""
    if opts.bind_core_list:
        os.environ[CORE_LIST_ENV] = ",".join(map(str, parse_core_list(opts.bind_core_list)))  # read by bind.py
    if opts.venv_script:
        # '$$' reaches the shell as '$': the elastic agent turns '$$' into '$' in arguments
        args = ["-c", 'source "$$0" && exec "$$@"', opts.venv_script, program, *args]
        program = "bash"
    if opts.enable_each_rank_log:
        import sys

        stamp = time.strftime("%Y%m%d%H%M%S")
        args = ["-m", "shardwise.launcher.rank_log", os.path.abspath(opts.enable_each_rank_log), stamp, "--", program, *args]
        program = os.environ.get("PYTHON_EXEC", sys.executable)
    return program, args
