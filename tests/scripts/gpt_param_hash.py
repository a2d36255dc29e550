"""Run examples/gpt/train.py unchanged, then report a hash of this rank's parameters.

The example builds its engine with ``deepspeed.initialize``; this wrapper keeps a reference
to it so the final parameters can be compared across ranks and runs.
"""
import hashlib
import json
import os
import runpy
import socket
import sys

import shardwise

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "gpt", "train.py")
engines = []
_initialize = shardwise.initialize


def _capture(*args, **kwargs):
    out = _initialize(*args, **kwargs)
    engines.append(out[0])
    return out


shardwise.initialize = _capture
sys.argv = [EXAMPLE, *sys.argv[1:]]
runpy.run_path(EXAMPLE, run_name="__main__")
engine = engines[0]
digest = hashlib.sha256()
for name, tensor in sorted(engine.module.state_dict().items()):
    digest.update(name.encode())
    digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
print("REPORT " + json.dumps({
    "rank": engine.global_rank, "world": engine.world_size, "host": socket.gethostname(),
    "params": digest.hexdigest(), "steps": engine.global_steps,
    "marker": os.environ.get("SW_TEST_MARKER"), "omp": os.environ.get("OMP_NUM_THREADS"),
}), flush=True)
