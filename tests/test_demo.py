"""The README's demo path end to end: `shardwise run` launching the example GPT script on 2 processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_shardwise_run_trains_example_script_on_two_ranks(tmp_path):
    cfg = json.load(open(os.path.join(ROOT, "examples", "gpt", "ds_config.json")))
    cfg["steps_per_print"] = 5
    cfg_path = tmp_path / "ds_config.json"
    cfg_path.write_text(json.dumps(cfg))
    cmd = [sys.executable, "-m", "shardwise", "run", "--num_procs", "2",
           os.path.join(ROOT, "examples", "gpt", "train.py"), "--deepspeed", "--deepspeed_config", str(cfg_path),
           "--steps", "10", "--save_dir", str(tmp_path / "ckpt")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "2 data-parallel ranks" in out
    assert "step=10" in out and "[rank0]:" in out
    assert (tmp_path / "ckpt" / "latest").read_text() == "global_step10"
    first, last = out.split("loss ")[-1].split(" after")[0].split(" -> ")
    assert float(last) < float(first)
