"""The pipeline example (examples/pipeline/train.py) trains under `shardwise run`, in fp16,
and gives the losses of the same layers run as one stage in one process."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "pipeline" / "train.py"


def _run(cmd: list[str], timeout: float = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def _losses(proc: subprocess.CompletedProcess) -> list[float]:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    line = next(l for l in proc.stdout.splitlines() if "LOSSES " in l)
    return json.loads(line.split("LOSSES ", 1)[1])


def test_seed_example_trains_in_fp16_like_one_stage():
    steps = "24"
    piped = _losses(_run([sys.executable, "-m", "shardwise", "run", "--num_procs", "2", str(SCRIPT),
                          "--steps", steps]))
    single = _losses(_run([sys.executable, str(SCRIPT), "--num-stages", "1", "--own-loader", "--steps", steps]))
    assert len(piped) == int(steps) and all(x == x and x < 10 for x in piped)
    assert sum(piped[-6:]) / 6 < sum(piped[:6]) / 6 - 0.2, piped  # it learns
    # fp16: identical computations, compare loosely (accumulated rounding in late steps)
    for a, b in zip(piped, single):
        assert abs(a - b) <= 2e-3 * abs(b), (piped, single)


def test_two_stages_in_one_process_is_refused():
    proc = _run([sys.executable, str(SCRIPT), "--steps", "1"])
    assert proc.returncode != 0
    assert "PipelineModule(num_stages=2) runs one stage per process but this is a single process" in proc.stderr
    assert "--num_procs 2" in proc.stderr
