"""Activation checkpointing: same losses and gradients as without it, lower measured peak memory,
the config block applied by initialize, and partitioned saved inputs across model-parallel ranks."""

from __future__ import annotations

import logging
import math
import os
import sys

import pytest
import torch

from distributed import run_distributed, run_subtests

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _gpt(use_ckpt: bool, **cfg):
    sys.path.insert(0, os.path.join(ROOT, "examples", "gpt"))
    try:
        from model import GPT, GPTConfig
    finally:
        sys.path.pop(0)
    from shardwise import checkpointing

    class CheckpointedGPT(GPT):
        def forward(self, idx):
            x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
            for block in self.blocks:
                x = checkpointing.checkpoint(block, x) if use_ckpt else block(x)
            return self.head(self.ln_f(x))

    torch.manual_seed(0)
    return CheckpointedGPT(GPTConfig(**cfg))


def _lm_loss(logits, targets):
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def _batches(n: int, batch: int, seq: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 128, (batch, seq + 1), generator=g) for _ in range(n)]


def test_same_losses_and_lower_peak_memory():
    from shardwise.profiling import PeakMemory

    shape = dict(n_layer=4, n_embd=64, n_head=4, block_size=64, vocab_size=128, dropout=0.1)
    results = {}
    for use_ckpt in (False, True):
        model = _gpt(use_ckpt, **shape)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        torch.manual_seed(123)  # dropout draws: checkpointing must replay the same ones
        losses, peaks = [], []
        for idx in _batches(2, 16, 64):
            with PeakMemory("cpu") as peak:
                loss = _lm_loss(model(idx[:, :-1]), idx[:, 1:])
                loss.backward()
            peaks.append(peak.bytes)
            losses.append(loss.item())
            grads = [p.grad.clone() for p in model.parameters()]
            opt.step()
            opt.zero_grad()
        results[use_ckpt] = (losses, peaks, grads)
    plain, ckpt = results[False], results[True]
    assert plain[0] == ckpt[0]  # bit-identical losses, dropout included
    assert all(torch.equal(a, b) for a, b in zip(plain[2], ckpt[2]))
    # activations of 4 blocks of 16x64x64 fp32 (256 KiB per tensor, ~20 per block) vs block inputs only
    assert max(plain[1][1:]) > 15 * 2**20, plain[1]
    assert max(ckpt[1][1:]) < 0.5 * max(plain[1][1:]), (plain[1], ckpt[1])


def _engine_losses(block: dict | None, rank: int, world: int, caplog_records: list):
    import shardwise
    from shardwise import checkpointing

    model = _gpt(block is not None, n_layer=2, n_embd=32, n_head=4, block_size=16, vocab_size=128)
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0.0,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}
    if block is not None:
        cfg["activation_checkpointing"] = block
    handler = _ListHandler(caplog_records)
    logging.getLogger("shardwise").addHandler(handler)
    logging.getLogger("shardwise").setLevel(logging.INFO)
    try:
        engine, *_ = shardwise.initialize(model=model, config=cfg)
        losses = []
        for idx in _batches(3, 4 * world, 16, seed=7):
            mine = idx[rank * 4:(rank + 1) * 4]
            engine.backward(_lm_loss(engine(mine[:, :-1]), mine[:, 1:]))
            engine.step()
            losses.append(engine.get_loss())
    finally:
        logging.getLogger("shardwise").removeHandler(handler)
    return losses, checkpointing.get_profile(), checkpointing.is_configured()


class _ListHandler(logging.Handler):
    def __init__(self, sink: list) -> None:
        super().__init__()
        self.sink = sink

    def emit(self, record) -> None:
        self.sink.append(record.getMessage())


def _engine_body(rank: int, world: int):
    records: list = []
    block = {"cpu_checkpointing": True, "synchronize_checkpoint_boundary": True, "profile": True,
             "partition_activations": True, "number_checkpoints": 2}
    out = run_subtests(_engine_losses, [None, block], rank, world, records)
    return out, [r for r in records if "activation checkpoint" in r]


def test_config_block_through_initialize_keeps_the_losses():
    (r0, logs0), (r1, _) = run_distributed(_engine_body, 2, timeout=120)
    (plain, _, configured_plain), (ckpt, prof, configured) = r0
    assert not configured_plain and configured
    assert plain == ckpt
    assert prof["calls"] == 2 * 3 and prof["forward_ms"] > 0 and prof["recompute_ms"] > 0
    assert any("recompute" in m for m in logs0) and any("forward" in m for m in logs0)
    assert any("partition_activations=True (model-parallel size 1)" in m for m in logs0)


class _WorldIsModelParallel:
    """The model-parallel part of a Megatron-style mpu: both ranks form one model-parallel group."""

    def get_model_parallel_world_size(self):
        return torch.distributed.get_world_size()

    def get_model_parallel_rank(self):
        return torch.distributed.get_rank()

    def get_model_parallel_group(self):
        return torch.distributed.group.WORLD


def _partition_case(partition: bool, rank: int, world: int):
    from shardwise import checkpointing

    checkpointing.configure(_WorldIsModelParallel(), partition_activations=partition, checkpoint_in_cpu=partition)
    model = _gpt(True, n_layer=3, n_embd=24, n_head=4, block_size=8, vocab_size=128)  # same weights everywhere
    idx = _batches(1, 3, 8, seed=5)[0]  # replicated activations, as under tensor parallelism
    loss = _lm_loss(model(idx[:, :-1]), idx[:, 1:])
    kept = checkpointing.get_profile()["kept_bytes"]
    loss.backward()
    return loss.item(), [p.grad.clone() for p in model.parameters()], kept


def _partition_body(rank: int, world: int):
    return run_subtests(_partition_case, [False, True], rank, world)


def test_partition_activations_keeps_a_slice_per_model_parallel_rank():
    (plain0, part0), (plain1, part1) = run_distributed(_partition_body, 2, timeout=120)
    for plain, part in ((plain0, part0), (plain1, part1)):
        assert plain[0] == part[0]
        assert all(torch.equal(a, b) for a, b in zip(plain[1], part[1]))
        assert plain[2] == 0
        per_input = math.ceil(3 * 8 * 24 / 2) * 4  # half of each block input (3 x 8 x 24 fp32), padded
        assert part[2] == 3 * per_input


def test_contiguous_memory_optimization_is_refused():
    from shardwise import checkpointing
    from shardwise.config import ConfigError, load_config

    with pytest.raises(ValueError, match="contiguous_memory_optimization"):
        checkpointing.configure(None, contiguous_checkpointing=True)
    cfg = load_config({"train_micro_batch_size_per_gpu": 1,
                       "activation_checkpointing": {"contiguous_memory_optimization": True}})
    with pytest.raises(ConfigError, match="not implemented yet: activation_checkpointing.contiguous_memory"):
        cfg.check_supported()


class ReentrantMLP(torch.nn.Module):
    """fc2 runs inside torch's reentrant checkpoint, once or (``reuse``) twice."""

    def __init__(self, reuse: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2, self.out = torch.nn.Linear(7, 13), torch.nn.Linear(13, 13), torch.nn.Linear(13, 3)
        self.reuse = reuse

    def _inner(self, t: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc2(t))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        h = checkpoint(self._inner, torch.tanh(self.fc1(x)), use_reentrant=True)
        if self.reuse:
            h = checkpoint(self._inner, h, use_reentrant=True)
        return self.out(h)


def _reentrant_case(stage: int, rank: int, world: int) -> dict:
    import torch.distributed as dist

    import shardwise
    from models import base_config, make_data, mse

    out = {}
    for reuse in (False, True):
        engine, *_ = shardwise.initialize(model=ReentrantMLP(reuse), config=base_config(
            train_micro_batch_size_per_gpu=4, zero_optimization={"stage": stage, "reduce_bucket_size": 40}))
        x, y = make_data(3, 8)
        losses = []
        try:
            for s in range(3):
                loss = mse(engine(x[s, rank * 4 : (rank + 1) * 4]), y[s, rank * 4 : (rank + 1) * 4])
                engine.backward(loss)
                engine.step()
                loss = loss.detach()
                dist.all_reduce(loss)
                losses.append(loss.item() / world)
        except RuntimeError as exc:
            out[reuse] = str(exc)
        else:
            out[reuse] = losses
    return out


def _reentrant_body(rank: int, world: int) -> list:
    return run_subtests(_reentrant_case, [0, 1, 2, 3], rank, world)


def test_reentrant_checkpointing_trains_and_reuse_across_regions_is_refused():
    """A parameter in one reentrant region trains as without ZeRO; one reused in two regions gets a
    second gradient after its bucket counted it ready: every stage refuses it by name (silently
    wrong gradients otherwise)."""
    from models import make_data, mse

    model = ReentrantMLP(False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    x, y = make_data(3, 8)
    ref = []
    for s in range(3):
        loss = mse(model(x[s]), y[s])
        opt.zero_grad()
        loss.backward()
        opt.step()
        ref.append(loss.item())
    for stage, res in zip([0, 1, 2, 3], run_distributed(_reentrant_body, 2, timeout=180)[0]):
        torch.testing.assert_close(torch.tensor(res[False]), torch.tensor(ref), rtol=1e-6, atol=1e-7)
        assert isinstance(res[True], str), (stage, res[True])
        assert "parameter 'fc2." in res[True] and "use_reentrant=False" in res[True], res[True]
