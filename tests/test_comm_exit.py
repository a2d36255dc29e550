"""A script that ends without destroy_process_group() gets its group destroyed at exit, while the
interpreter is still whole (gloo torn down during finalization can abort the process)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import atexit
    import torch.distributed as dist

    # Registered first, so it runs last: after shardwise's own exit handler.
    atexit.register(lambda: print("initialized at exit:", dist.is_initialized(), flush=True))

    import torch
    import shardwise
    from shardwise import comm

    try:  # DeepSpeed's rule: dist_init_required=False needs a group to exist already
        shardwise.init_distributed(dist_backend="gloo", dist_init_required=False)
    except RuntimeError as e:
        print("refused:", e, flush=True)
    shardwise.init_distributed(dist_backend="gloo", verbose=False)
    shardwise.init_distributed(dist_backend="gloo", dist_init_required=False)  # a group exists: nothing to do
    t = torch.ones(4)
    comm.all_reduce(t)
    print("sum", t.tolist(), flush=True)
""")


def test_group_destroyed_at_exit_when_the_script_did_not() -> None:
    env_drop = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")
    env = {k: v for k, v in os.environ.items() if k not in env_drop}
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    assert "sum [1.0, 1.0, 1.0, 1.0]" in done.stdout
    assert "refused: init_distributed(dist_init_required=False) but no process group exists" in done.stdout
    assert "initialized at exit: False" in done.stdout, done.stdout + done.stderr
