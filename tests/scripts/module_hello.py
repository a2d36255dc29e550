"""Launcher test module (run with --module): report argv, environment and the pid file."""
import json
import os
import sys
import tempfile

pid_file = os.path.join(tempfile.gettempdir(), f"{os.getppid()}.shardwise")
report = {
    "argv": sys.argv[1:],
    "rank": os.environ.get("RANK"),
    "omp": os.environ.get("OMP_NUM_THREADS"),
    "pid_file": open(pid_file).read() if os.path.exists(pid_file) else None,
    "launcher_pid": os.getppid(),
}
print(f"REPORT {json.dumps(report, sort_keys=True)}", flush=True)
