"""benchmarks/gpu_check.py (``make gpu-check``): skips cleanly without CUDA, and its checks run on the CPU."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.py"


def _main(monkeypatch, *argv: str) -> int:
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(sys, "argv", ["gpu_check.py", *argv])
    return module.main()


def test_cuda_run_or_clean_skip(monkeypatch, capsys):
    rc = _main(monkeypatch, "--size", "tiny", "--steps", "3", "--warmup", "1", "--runs", "ZeRO-0")
    out = capsys.readouterr().out
    assert rc == 0
    if torch.cuda.is_available():
        assert "| ZeRO-0 |" in out and "| NO |" not in out
    else:
        assert "skipped, no CUDA device" in out and "|" not in out


def test_cpu_dry_run_matches_the_torch_loop(monkeypatch, capsys):
    rc = _main(monkeypatch, "--device", "cpu", "--size", "tiny", "--dtype", "fp32", "--steps", "3", "--warmup", "1",
               "--peak-tflops", "1", "--runs", "ZeRO-3 + offload")
    out = capsys.readouterr().out
    assert rc == 0, out
    rows = [line for line in out.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert [r.split(" | ")[0] for r in rows] == ["| plain torch", "| ZeRO-3 + offload"]
    assert all(r.endswith("| yes |") and "%" in r for r in rows), out


def test_cpu_dry_run_offload_states_frees_the_model_states(monkeypatch, capsys):
    """The offload_states case on the CPU (the same code as on CUDA, bytes counted from the live tensors):
    what offload_states frees is ZeRO's 16 bytes per parameter, and reload_states brings it back. A fake tensor
    of symbolic size stays alive meanwhile, as torch.compile leaves some behind: it holds no memory."""
    fake = _symbolic_fake_tensor()  # noqa: F841 (kept alive through the run)
    rc = _main(monkeypatch, "--device", "cpu", "--size", "tiny", "--steps", "3", "--warmup", "1",
               "--runs", "offload_states ZeRO-1", "offload_states ZeRO-3")
    out = capsys.readouterr().out
    assert rc == 0, out
    rows = [line for line in out.splitlines() if line.startswith("| offload_states")]
    assert [r.split(" | ")[0] for r in rows] == ["| offload_states ZeRO-1", "| offload_states ZeRO-3"]
    for r in rows:
        cells = [c.strip() for c in r.strip("|").split("|")]
        before, after, freed, formula, reloaded = map(float, cells[1:6])
        assert cells[-1] == "yes" and freed > 0 and abs(freed - formula) <= 0.1 * formula and reloaded == before, r


def _symbolic_fake_tensor() -> torch.Tensor:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    fake = FakeTensorMode(shape_env=ShapeEnv(), static_shapes=False).from_tensor(torch.ones(4, 5))
    assert not isinstance(fake.untyped_storage().nbytes(), int)  # what a byte count must skip
    return fake
