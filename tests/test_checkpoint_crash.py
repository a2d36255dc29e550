"""SIGKILL at random moments of a save never costs the last complete checkpoint.

A child process trains and saves in a loop (re-saving the same few tags, so replacing a tag is
exercised); the test kills it with SIGKILL part-way through a save, checks that ``latest`` names
a complete checkpoint that passes its checksums and holds exactly the weights logged when that
save began, and restarts the child, which resumes from it.  Repeated, on the same folder.
"""

from __future__ import annotations

import hashlib
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

CHILD = r'''
import hashlib, os, sys, time
import torch
import shardwise
from shardwise.utils import safe_get_full_fp32_param

save_dir, log_path = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(6)])
config = {"train_micro_batch_size_per_gpu": 16, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
          "bf16": {"enabled": True}, "zero_optimization": {"stage": 1, "reduce_bucket_size": 100000}}
engine, *_ = shardwise.initialize(model=model, config=config)
log = open(log_path, "a")

def note(*words):
    log.write(" ".join(str(w) for w in words) + "\n")
    log.flush()
    os.fsync(log.fileno())

def digest():
    h = hashlib.sha256()
    for name, p in sorted(engine.module.named_parameters()):
        h.update(name.encode() + safe_get_full_fp32_param(p).numpy().tobytes())
    return h.hexdigest()

path, _ = engine.load_checkpoint(save_dir)
note("resumed", engine.global_steps, digest()) if path else note("fresh")
x = torch.randn(16, 256).bfloat16()
while True:
    loss = engine(x).float().pow(2).mean()
    engine.backward(loss)
    engine.step()
    tag = f"t{engine.global_steps % 3}"
    note("begin", tag, engine.global_steps, digest(), time.time())
    engine.save_checkpoint(save_dir, tag=tag)
    note("end", tag, engine.global_steps, time.time())
'''


def _records(log: Path) -> list[list[str]]:
    return [line.split() for line in log.read_text().splitlines() if line.strip()] if log.exists() else []


def _text(f) -> str:
    f.seek(0)
    return f.read()[-4000:]


def _digest(state: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(state):
        h.update(name.encode() + state[name].numpy().tobytes())
    return h.hexdigest()


def _run_and_kill(script: Path, save_dir: Path, log: Path, rng: random.Random) -> tuple[int, list[str]]:
    """Start the child, let it finish one save, kill it during a later one. Returns (lines before, resume line)."""
    before = len(_records(log))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    err = open(log.with_name("child-stderr.txt"), "w+")  # a file, not a pipe that could fill up
    child = subprocess.Popen([sys.executable, str(script), str(save_dir), str(log)], env=env,
                             stdout=subprocess.DEVNULL, stderr=err)
    try:
        deadline = time.monotonic() + 120
        while True:  # one complete save in this run, and its duration
            recs = _records(log)[before:]
            ends = [r for r in recs if r[0] == "end"]
            if ends:
                break
            assert child.poll() is None, f"child exited early:\n{_text(err)}"
            assert time.monotonic() < deadline, "child made no checkpoint within 120 s"
            time.sleep(0.002)
        begin = next(r for r in recs if r[0] == "begin")
        duration = float(ends[0][3]) - float(begin[4])
        seen = len(recs)
        while len(_records(log)[before:]) == seen or _records(log)[-1][0] != "begin":  # the next save began
            assert child.poll() is None, f"child exited:\n{_text(err)}"
            assert time.monotonic() < deadline, "child made no further save"
            time.sleep(0.001)
        time.sleep(rng.uniform(0, duration))
        child.send_signal(signal.SIGKILL)
        child.wait(30)
        assert child.returncode == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        err.close()
    return before, _records(log)[before]


def _check_latest(save_dir: Path, log: Path) -> bool:
    """``latest`` is complete, verified, and holds the weights logged when its save began; no
    completed save was lost.  Returns True when the kill landed inside a save."""
    from shardwise.checkpoint import get_fp32_state_dict_from_checkpoint, open_checkpoint

    recs = _records(log)
    ckpt = open_checkpoint(save_dir)
    ckpt.verify()
    step = ckpt.manifest["engine"]["global_steps"]
    begins = {int(r[2]): r for r in recs if r[0] == "begin"}
    assert begins[step][1] == ckpt.tag
    assert _digest(get_fp32_state_dict_from_checkpoint(save_dir)) == begins[step][3], \
        f"checkpoint {ckpt.tag} (step {step}) does not hold the weights of that step"
    last_done = max(int(r[2]) for r in recs if r[0] == "end")
    assert step >= last_done, f"latest is step {step} but step {last_done} had completed"
    return recs[-1][0] == "begin"


def test_sigkill_during_saves_leaves_the_last_complete_checkpoint(tmp_path):
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    save_dir, log = tmp_path / "ckpt", tmp_path / "log.txt"
    rng = random.Random(1234)
    mid_save = 0
    trials = 6
    for trial in range(trials):
        if trial == trials - 1:
            # A crash between the two renames of a re-save: only ".old.<tag>" and a partial ".tmp.<tag>".
            tag = (save_dir / "latest").read_text()
            os.rename(save_dir / tag, save_dir / f".old.{tag}")
            (save_dir / f".tmp.{tag}").mkdir(exist_ok=True)
            shutil.copy(save_dir / f".old.{tag}" / "manifest.json", save_dir / f".tmp.{tag}" / "model.safetensors")
            _check_latest(save_dir, log)  # loads through ".old.<tag>"
        before, first = _run_and_kill(script, save_dir, log, rng)
        if trial == 0:
            assert first == ["fresh"]
        else:  # the restarted child resumed from the checkpoint checked after the previous kill
            begins = {int(r[2]): r for r in _records(log)[:before] if r[0] == "begin"}
            assert first[0] == "resumed" and first[2] == begins[int(first[1])][3], first
        mid_save += _check_latest(save_dir, log)
    assert mid_save >= 2, f"only {mid_save} of {trials} kills landed inside a save"
    # The last run's first save put the interrupted tag back; debris is only what the last kill left.
    leftovers = [p.name for p in save_dir.iterdir() if p.name.startswith(".old.")]
    assert len(leftovers) <= 1, leftovers
