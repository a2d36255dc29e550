"""DeepSpeed's small runtime helpers that projects import: ``runtime.utils.move_to_device`` (accelerate),
``utils.timer.SynchronizedWallClockTimer`` (ArcticTraining, Megatron-DeepSpeed), ``comm.TorchBackend``,
the activation-checkpointing RNG-tracker names gpt-neox reads, and DeepSpeed-Inference's config classes."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from shardwise.runtime.utils import move_to_device, partition_min_spread, prefix_sum_inc
from shardwise.utils.wall_clock import NullTimerGroup, TimerGroup, trimmed_mean

REPO = Path(__file__).resolve().parents[1]


def test_move_to_device_walks_containers_and_moves_matches_in_place():
    a, b, c = torch.ones(2), torch.zeros(3, dtype=torch.float64), torch.arange(3)
    moved = move_to_device({"x": [a, (b, 7)], "y": c}, "meta")
    assert moved["x"][0].device.type == "meta" and moved["x"][1][0].device.type == "meta"
    assert moved["x"][1][1] == 7 and isinstance(moved["x"][1], tuple) and moved["y"].device.type == "meta"
    assert a.device.type == "cpu"  # without a criterion: copies, the originals stay
    # with a criterion: a matching tensor is moved in place and returned itself, its storage swapped for the
    # moved copy (seen here through a dtype, as ``.to`` takes one: a CPU-only machine has no second device)
    keep = [a, b]
    out = move_to_device(keep, torch.float32, criterion_func=lambda t: torch.is_tensor(t) and t.dtype == torch.float64)
    assert out is not keep and out[1] is b and b.dtype == torch.float32
    out = move_to_device(keep, "meta", criterion_func=lambda t: isinstance(t, list) and False)
    assert out[0].device.type == "meta" and a.device.type == "cpu"  # non-matching: copied
    # the criterion sees containers too: a matching list is handed to .to (here: no such method)
    with pytest.raises(AttributeError):
        move_to_device(keep, "cpu", criterion_func=lambda t: isinstance(t, list))


def test_prefix_sum_inc():
    weights = [3, 4, 5]
    assert prefix_sum_inc(weights) == [3, 7, 12] and weights == [3, 4, 5] and prefix_sum_inc([]) == []


@pytest.mark.parametrize("weights, parts, expected", [
    # DeepSpeed 0.19.8's partition_balanced on the same input (its unit test's cases and a few more)
    ([1, 2, 1], 4, [0, 1, 2, 3, 3]), ([1, 1, 1, 1], 4, [0, 1, 2, 3, 4]), ([1, 1, 1, 1, 1], 4, [0, 2, 3, 4, 5]),
    ([1, 1, 1, 1, 0, 1], 4, [0, 2, 3, 5, 6]), ([5, 0, 3, 8, 2, 2, 1], 3, [0, 3, 4, 7]),
    ([3, 1, 2, 8, 0, 0, 5, 1, 1, 2], 4, [0, 3, 6, 7, 10]), ([2, 2], 1, [0, 2]),
])
def test_partition_min_spread_is_deepspeeds_partition_balanced(weights, parts, expected):
    assert partition_min_spread(weights, parts) == expected


def test_timer_group_records_intervals_and_logs(capsys):
    timers = TimerGroup()
    t = timers("fwd")
    assert timers("fwd") is t and timers.get_timers() == {"fwd": t}
    for pause in (0.02, 0.01):
        t.start()
        time.sleep(pause)
        t.stop()
    total = t.elapsed(reset=False)
    assert 30.0 <= total < 1000.0 and len(t.records) == 2
    assert t.mean() == pytest.approx(total / 2)  # two records: nothing trimmed
    with pytest.raises(RuntimeError, match="already been started"):
        t.start(), t.start()
    t.stop()
    assert t.elapsed() > total and t.records == [] and not t.started_  # reset
    t.start()
    time.sleep(0.01)
    running = t.elapsed(reset=False)  # an open interval counts up to now and stays open
    assert running >= 10.0 and t.started_
    t.stop()
    timers("bwd").start()
    timers("bwd").stop()
    timers.log(["fwd", "bwd", "missing"], normalizer=2.0)
    line = capsys.readouterr().out.strip()
    assert line.startswith("[Rank 0] time (ms) | fwd: ") and "| bwd: " in line and "missing" not in line
    assert timers("fwd").records == []  # log resets by default
    means = timers.get_mean(["bwd"], normalizer=1.0)
    assert set(means) == {"bwd"}
    assert trimmed_mean([9.0, 1.0] + [5.0] * 8, 0.1) == 5.0 and trimmed_mean([], 0.1) == 0
    null = NullTimerGroup()
    null("x").start()
    null("x").stop()
    assert null("x").elapsed() == 0 and null.get_timers() == {}


def test_rng_tracker_names_gpt_neox_reads():
    from shardwise import checkpointing

    assert checkpointing._MODEL_PARALLEL_RNG_TRACKER_NAME == "model-parallel-rng"
    assert checkpointing._CUDA_RNG_STATE_TRACKER is checkpointing.get_cuda_rng_tracker()
    checkpointing.model_parallel_cuda_manual_seed(123, tp_rank=0)
    state = torch.get_rng_state()
    first = torch.rand(3)
    checkpointing._set_cuda_rng_state(state)  # the generator goes back: the same draws again
    assert torch.equal(torch.rand(3), first)
    with checkpointing._CUDA_RNG_STATE_TRACKER.fork():
        forked = torch.rand(3)
    torch.manual_seed(123 + 2718)
    assert torch.equal(torch.rand(3), forked)  # Megatron's offset for tensor rank 0


_PROBE = r"""
import torch
import deepspeed
import deepspeed.comm as dist
from deepspeed.comm.torch import TorchBackend
from deepspeed.runtime.utils import move_to_device
from deepspeed.utils.timer import (SynchronizedWallClockTimer, NoopTimer, BACKWARD_GLOBAL_TIMER,
    BACKWARD_INNER_GLOBAL_TIMER, BACKWARD_INNER_MICRO_TIMER, BACKWARD_MICRO_TIMER, FORWARD_GLOBAL_TIMER)
import deepspeed.runtime.activation_checkpointing.checkpointing as checkpointing
from deepspeed.inference.config import (DeepSpeedInferenceConfig, DeepSpeedTPConfig, DeepSpeedMoEConfig,
    QuantizationConfig, InferenceCheckpointConfig, DtypeEnum)
# gpt-neox's megatron/mpu/random.py, verbatim reads
_MODEL_PARALLEL_RNG_TRACKER_NAME = deepspeed.checkpointing._MODEL_PARALLEL_RNG_TRACKER_NAME
_CUDA_RNG_STATE_TRACKER = deepspeed.checkpointing._CUDA_RNG_STATE_TRACKER
_set_cuda_rng_state = checkpointing._set_cuda_rng_state
assert checkpointing.get_cuda_rng_tracker() is _CUDA_RNG_STATE_TRACKER
assert (BACKWARD_GLOBAL_TIMER, BACKWARD_INNER_MICRO_TIMER, FORWARD_GLOBAL_TIMER) == ("bwd", "bwd_inner_microstep", "fwd")
t = SynchronizedWallClockTimer()
t("step").start(); t("step").stop(); assert t("step").elapsed() >= 0.0
# DeepSpeedExamples' communication benchmark reads the class's all-gather function; a backend object joins a group
assert dist.TorchBackend is TorchBackend and TorchBackend.get_all_gather_function() is torch.distributed.all_gather_into_tensor
backend = TorchBackend("gloo", None, None, rank=0, world_size=1)
x = torch.ones(4)
backend.all_reduce(x)
out = torch.empty(4)
backend.all_gather_into_tensor(out, x)
assert torch.equal(out, x) and backend.get_world_size() == 1 and backend.is_initialized()
# inference config classes: DeepSpeed's defaults, aliases, deprecations
c = DeepSpeedInferenceConfig()
assert (c.dtype, c.max_out_tokens, c.tensor_parallel.tp_size, c.replace_with_kernel_inject) == (torch.float16, 1024, 1, False)
assert DeepSpeedInferenceConfig(tp={"tp_size": 2}, kernel_inject=True, dtype="bf16").tensor_parallel.tp_size == 2
assert DeepSpeedInferenceConfig(mp_size=4).tensor_parallel.tp_size == 4
assert DeepSpeedMoEConfig(num_experts=[8]).moe_experts == [8] and QuantizationConfig().weight.num_bits == 8
assert DtypeEnum.from_str("half") is DtypeEnum.fp16
try:
    DeepSpeedTPConfig(tp_sise=2)
    raise SystemExit("typo accepted")
except Exception as e:
    assert "tp_sise" in str(e)
# init_inference takes them (a world of one here: tp_size 1)
model = torch.nn.Linear(4, 4)
engine = deepspeed.init_inference(model, tensor_parallel=DeepSpeedTPConfig(tp_size=1), dtype=torch.float32)
assert engine.module is model
engine = deepspeed.init_inference(model, config=DeepSpeedInferenceConfig(dtype=torch.float32, tp={"tp_size": 1}))
try:
    deepspeed.init_inference(model, config=DeepSpeedInferenceConfig(kernel_inject=True))
    raise SystemExit("kernel injection accepted")
except ValueError as e:
    assert "replace_with_kernel_inject" in str(e)
print("ok")
"""


def test_deepspeed_paths(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "compat" / "deepspeed"), str(REPO)])}
    out = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=180,
                         cwd=tmp_path)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


def _partitioned_body(rank, world_size):
    from shardwise.utils.partitioned_tensor import PartitionedTensor

    results = []
    for shape in [(4, 3), (7,), (2, 1, 5)]:  # 12 and 10 elements split evenly over the 2 ranks, 7 unevenly
        full = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape) * 1.5
        part = PartitionedTensor(full, group=None)
        n = full.numel()
        bounds = [0, (n + 1) // 2, n]  # the first piece takes the odd element
        assert part.partition == bounds and part.full_size() == list(shape)
        assert torch.equal(part.data(), full.flatten()[bounds[rank]:bounds[rank + 1]])
        again = PartitionedTensor.from_meta(part.to_meta(), part.data(), group=None, device="cpu")
        assert again.partition == part.partition and again.full_size() == list(shape)
        assert torch.equal(again.full(), full) and torch.equal(part.full(), full)
        results.append(part.to_meta().tolist())
    bad = part.to_meta().clone()
    bad[len(part.full_size()) + 2] = 1 - rank  # claims the other rank's piece
    try:
        PartitionedTensor.from_meta(bad, part.data(), group=None)
    except ValueError as exc:
        assert "cut for rank" in str(exc)
    else:
        raise AssertionError("a piece of the other rank was accepted")
    return results


def test_partitioned_tensor_over_two_ranks():
    from distributed import run_distributed

    metas = run_distributed(_partitioned_body, 2)
    # DeepSpeed's encoding: [ndim, *shape, num_parts, rank, *boundaries]
    assert metas[0][0] == [2, 4, 3, 2, 0, 0, 6, 12] and metas[1][1] == [1, 7, 2, 1, 0, 4, 7]
