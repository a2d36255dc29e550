"""DeepSpeed's ZeRO-1/2 optimizer helpers through the compat package (deepspeed.runtime.zero.stage_1_and_2):
``IPGBucket``; ``DeepSpeedZeroOptimizer.allreduce_and_copy`` / ``allreduce_and_copy_with_multiple_ranks`` on an
instance the caller sets up (results copied back only where this rank consumes them, the reduction stream
recorded on the tensors it touched when communication overlaps on an accelerator that does not order streams
itself); ``_maybe_reduce_autoep_folding_tp_gradient`` (which ZeRO modes correct a gradient in the hook); and
that ``deepspeed.initialize``'s world never builds one (construction refuses with the reason).

The checks are the ``_check_*`` functions below; they run together in one subprocess with the compat
package as ``deepspeed`` (its import hook stays out of this process), which prints one JSON verdict each.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
COMPAT = REPO / "compat" / "deepspeed"


class _Buf:
    """A bucket tensor stand-in that records what is copied into it and which streams are recorded on it."""

    def __init__(self, name):
        self.name, self.copied, self.streams = name, None, []

    def copy_(self, other):
        self.copied = other
        return self

    def record_stream(self, stream):
        self.streams.append(stream)


class _Accelerator:
    def __init__(self, orders_streams):
        self.orders_streams, self.synced, self.entered = orders_streams, 0, []

    def resolves_data_dependency(self):
        return self.orders_streams

    def synchronize(self):
        self.synced += 1

    def current_stream(self):
        return "current"

    @contextmanager
    def stream(self, stream):
        self.entered.append(stream)
        yield


@contextmanager
def _patched(module, **values):
    saved = {k: getattr(module, k) for k in values}
    for k, v in values.items():
        setattr(module, k, v)
    try:
        yield
    finally:
        for k, v in saved.items():
            setattr(module, k, v)


def _optimizer(overlap):
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    opt = DeepSpeedZeroOptimizer.__new__(DeepSpeedZeroOptimizer)
    opt.overlap_comm, opt.reduction_stream, opt.dp_process_group = overlap, "reduction", None
    opt.previous_reduced_grads = {}
    opt.reduced = _Buf("reduced")
    opt.calls = []

    def allreduce_bucket(bucket, dtype, **kwargs):
        opt.calls.append((len(bucket), dtype, kwargs.get("rank")))
        return opt.reduced

    opt.allreduce_bucket = allreduce_bucket
    opt.unflatten = lambda reduced, bucket: [f"part{i}" for i in range(len(bucket))]
    return opt


# ------------------------------------------------------------------------------------- the checks

def _check_ipg_bucket():
    from deepspeed.runtime.zero.stage_1_and_2 import IPGBucket

    b = IPGBucket()
    assert (b.buffer, b.params, b.grads, b.elements, b.index, b.has_moe_params, b.copy_streams) == \
        ([], [], [], 0, 0, False, set())
    b.buffer.append("buf")
    b.params.append("p")
    b.grads.append("g")
    b.elements, b.index, b.has_moe_params = 7, 1, True
    b.copy_streams.update({"s1", "s2"})
    b.clear()
    assert (b.params, b.grads, b.elements, b.has_moe_params, b.copy_streams) == ([], [], 0, False, set())
    assert b.buffer == ["buf"] and b.index == 1  # the buffers and the fill index outlive a clear
    assert IPGBucket().copy_streams is not IPGBucket().copy_streams


def _check_allreduce_and_copy_streams():
    import torch

    from deepspeed.runtime.zero import stage_1_and_2 as mod

    for orders_streams in (False, True):
        acc = _Accelerator(orders_streams)
        opt = _optimizer(overlap=True)
        old = torch.nn.Parameter(torch.ones(1))
        old.grad = torch.ones(1)
        opt.previous_reduced_grads = {torch.float16: [old]}
        bucket = [_Buf("a"), _Buf("b")]
        with _patched(mod, get_accelerator=lambda: acc):
            opt.allreduce_and_copy(bucket, torch.float16)
        assert acc.entered == ["reduction"] and acc.synced == (0 if orders_streams else 1)
        assert old.grad is None and opt.previous_reduced_grads == {torch.float16: []}
        assert [b.copied for b in bucket] == ["part0", "part1"]
        expected = [] if orders_streams else ["reduction"]
        assert opt.reduced.streams == expected and all(b.streams == expected for b in bucket)
    # no overlap: the current stream, nothing recorded; a reduction to another rank copies nothing here
    acc = _Accelerator(False)
    opt = _optimizer(overlap=False)
    bucket = [_Buf("a")]
    with _patched(mod, get_accelerator=lambda: acc):
        opt.allreduce_and_copy(bucket, torch.bfloat16, rank=1)
    assert acc.entered == ["current"] and opt.calls == [(1, torch.bfloat16, 1)]
    assert bucket[0].copied is None and opt.reduced.streams == [] and bucket[0].streams == []


def _check_allreduce_and_copy_with_multiple_ranks():
    import torch

    from deepspeed.runtime.zero import stage_1_and_2 as mod

    opt = _optimizer(overlap=True)
    bucket = [_Buf(n) for n in "abcd"]
    with _patched(mod, get_accelerator=lambda: _Accelerator(False)):
        opt.allreduce_and_copy_with_multiple_ranks(bucket, torch.float16,
                                                   bucket_ranks=[0, 1, frozenset({0, 1}), frozenset({1})])
    assert [b.copied for b in bucket] == ["part0", None, "part2", None]  # this process is rank 0
    assert [b.streams for b in bucket] == [["reduction"], [], ["reduction"], []]
    assert opt.reduced.streams == ["reduction"]


def _check_autoep_folding_in_hook():
    from types import SimpleNamespace

    import torch

    from deepspeed.runtime.zero import stage_1_and_2 as mod

    calls = []

    def correct(spec, param, grad, *, tp_group, param_name=None, use_correction_marker=True):
        calls.append((spec, param, tp_group, use_correction_marker))
        grad.mul_(0.5)

    spec = SimpleNamespace(tp_size=2)
    for partition_gradients, overlap, expected_marker in ((True, False, False), (False, True, True),
                                                          (False, False, None), (True, True, False)):
        calls.clear()
        opt = _optimizer(overlap)
        opt.partition_gradients = partition_gradients
        opt.autoep_folding_tp_group, opt.autoep_folding_spec = "tp", spec
        param, grad = torch.nn.Parameter(torch.ones(2)), torch.full((2, ), 4.0)
        with _patched(mod, apply_folding_correction_to_grad_buffer=correct):
            opt._maybe_reduce_autoep_folding_tp_gradient(param, grad)
            param.ds_grad_is_ready = False  # a gradient still accumulating is left alone
            opt._maybe_reduce_autoep_folding_tp_gradient(param, grad)
        if expected_marker is None:  # non-overlapped ZeRO-1: the engine's boundary sweep corrects it
            assert calls == [] and grad.tolist() == [4.0, 4.0]
        else:
            assert calls == [(spec, param, "tp", expected_marker)] and grad.tolist() == [2.0, 2.0]
    opt = _optimizer(True)
    opt.partition_gradients = True
    opt.configure_autoep_folding_tp_gradient_reduction(SimpleNamespace(tp_size=1))
    assert opt.autoep_folding_tp_group is None and opt.autoep_folding_spec is None
    opt._maybe_reduce_autoep_folding_tp_gradient(torch.nn.Parameter(torch.ones(1)), torch.ones(1))  # no group: no-op


def _check_never_built():
    import pytest

    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    with pytest.raises(NotImplementedError, match="engine.optimizer is the torch optimizer"):
        DeepSpeedZeroOptimizer(None, None, None, None)


_CHECKS = sorted(name[len("_check_"):] for name in dict(globals()) if name.startswith("_check_"))


def _run_all() -> None:
    """In the subprocess: run every check, print ``{check: "ok" | error}`` as the last line."""
    import traceback

    results = {}
    for name in _CHECKS:
        try:
            globals()["_check_" + name]()
            results[name] = "ok"
        except Exception:  # noqa: BLE001 -- reported to the test
            results[name] = traceback.format_exc()[-2000:]
    print(json.dumps(results))


# ------------------------------------------------------------------------------------ the tests

@pytest.fixture(scope="module")
def compat_results():
    env = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONWARNINGS="ignore",
               PYTHONPATH=os.pathsep.join([str(COMPAT), str(REPO), str(REPO / "tests")]))
    proc = subprocess.run([sys.executable, "-c", "import test_deepspeed_zero_optimizer_helpers as t; t._run_all()"],
                          env=env, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("check", _CHECKS)
def test_zero_optimizer_helpers(compat_results, check):
    assert compat_results.get(check) == "ok", compat_results.get(check, "not run")
