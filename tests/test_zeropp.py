"""ZeRO++ (zero/zeropp.py): the block quantizer, and qwZ / hpZ / qgZ on real gloo processes.

The distributed cases run in one spawn of 4 ranks laid out as 2 nodes x 2 ranks (``LOCAL_WORLD_SIZE=2``,
and ``zero_hpz_partition_size: 2`` where hpZ is on) training the reference GPT (tiny) at ZeRO-3.
"""

from __future__ import annotations

import os

import pytest
import torch

from distributed import run_distributed
from shardwise.comm import quantize as q

STEPS = int(os.environ.get("ZEROPP_TEST_STEPS", 60))  # (ZEROPP_TEST_STEPS=200: the length; see docs/zero.md)
NODE = 2  # ranks per node
PLAIN = {}
ALL_OFF = {"zero_quantized_weights": False, "zero_hpz_partition_size": 1, "zero_quantized_gradients": False}
QW = {"zero_quantized_weights": True}
HPZ = {"zero_hpz_partition_size": NODE}
QG = {"zero_quantized_gradients": True}
QG_LOCO = {"zero_quantized_gradients": True, "zeropp_loco_param": {"err_beta": 0.8, "reset_T": 1024}}
ALL = {**QW, **HPZ, **QG}


# -- the quantizer --------------------------------------------------------------------------------
@pytest.mark.parametrize("bits", [8, 4])
def test_round_trip_error_is_half_a_step_but_where_the_top_code_clips(bits):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64 * 37, generator=g) * torch.logspace(-3, 2, 64 * 37)[torch.randperm(64 * 37, generator=g)]
    x[:64] = 0  # an all-zero block stays exactly zero
    block = 64
    values, scales = q.quantize(x, block, bits)
    assert values.dtype == torch.uint8 and values.numel() == (x.numel() if bits == 8 else x.numel() // 2)
    assert scales.numel() == x.numel() // block and scales.dtype == torch.float32
    y = q.dequantize(values, scales, block, bits)
    err = (y - x).abs()
    step = q.error_bound(x, block, bits)  # the block's scale: 2 * absmax / 2**bits
    torch.testing.assert_close(step.view(-1, block)[:, 0], scales)
    assert torch.all(y[:64] == 0)
    tol = 1e-6 * x.abs().max()
    clipped = x > (2 ** (bits - 1) - 0.5) * step  # codes above the top one (+absmax is 2**(bits-1)) are cut
    assert torch.all(err[~clipped] <= step[~clipped] / 2 + tol)
    assert torch.all(err <= step + tol)
    # int8 is the finer code
    if bits == 4:
        v8, s8 = q.quantize(x, block, 8)
        assert (q.dequantize(v8, s8, block, 8) - x).abs().sum() < err.sum() / 8


def test_int4_packing_and_int8_codes_are_deepspeeds():
    # one block of 8: absmax 4 -> scale 2*4/16 = 0.5 (int4); codes round(x / 0.5) clamped to [-8, 7]
    x = torch.tensor([4.0, -4.0, 0.25, -0.3, 1.0, 0.0, 3.9, -1.1])
    values, scales = q.quantize(x, 8, 4)
    assert scales.tolist() == [0.5]
    codes = [7, -8, 0, -1, 2, 0, 7, -2]  # 4/0.5 = 8 is clamped to 7; round half to even: 0.5 -> 0
    nib = [c & 0xF for c in codes]
    assert values.tolist() == [nib[i] | (nib[i + 1] << 4) for i in range(0, 8, 2)]
    torch.testing.assert_close(q.dequantize(values, scales, 8, 4), torch.tensor(codes, dtype=torch.float32) * 0.5)
    v8, s8 = q.quantize(x, 8, 8)
    assert s8.tolist() == [4.0 * 2 / 256]
    assert v8.view(torch.int8).tolist()[:2] == [127, -128]


def test_weight_block_layout_follows_deepspeeds_group_rule():
    # DeepSpeed's CUDAQuantizer: ceil(n / 8000) groups, grown until 8 * groups divides n, doubled while > 8000
    assert q.deepspeed_groups(8000) == 1 and q.weight_block_size(8000) == 8000
    assert q.deepspeed_groups(64000) == 8 and q.weight_block_size(64000) == 8000
    assert q.deepspeed_groups(4096) == 1  # smaller than the target: one group
    assert q.deepspeed_groups(12000) == 2 and q.weight_block_size(12000) == 6000
    assert q.deepspeed_groups(1001) is None  # not a multiple of 8: DeepSpeed has no layout
    assert q.weight_block_size(1001) == 1002  # padded to one even block instead
    assert q.weight_block_size(100_003) == q.FALLBACK_BLOCK
    with pytest.raises(ValueError, match="do not cut into blocks of 3"):
        q.quantize(torch.zeros(10), 3)


# -- distributed ----------------------------------------------------------------------------------
def _config(extra: dict, top: dict | None = None) -> dict:
    top = dict(top or {})
    # units of at most 4000 elements: the embeddings, each block, the head (every one released after use)
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 4000,
            **top.pop("zero", {}), **extra}
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "Adam", "params": {"lr": 3e-3}}, "comms_logger": {"enabled": True},
            **top, "zero_optimization": zero}


# gradient accumulation, clipping, bf16 and the optimizer offloaded to the CPU, all at once
COMPOSED = {"gradient_accumulation_steps": 2, "gradient_clipping": 0.5, "bf16": {"enabled": True},
            "zero": {"offload_optimizer": {"device": "cpu"}}}


def _train(rank, extra: dict, steps: int, *, top=None, freeze=False, data_seed=0, save=None, load=None):
    import shardwise
    from shardwise.comm import ops
    from shardwise.models.gpt import GPT, GPTConfig

    cfg = GPTConfig(vocab_size=32, seq_len=8, hidden=16, n_layers=2, n_heads=2)
    model = GPT(cfg)
    if freeze:  # the embedding layer frozen (LoRA-like: zero_quantized_nontrainable_weights)
        for p in model[0].parameters():
            p.requires_grad_(False)
    engine, *_ = shardwise.initialize(model=model, config=_config(extra, top))
    if load is not None:
        engine.load_checkpoint(load)
    g = torch.Generator().manual_seed(data_seed * 1000 + rank)
    data = torch.randint(0, 32, (16, 2, 9), generator=g)
    losses, cross, groups = [], [], []
    for step in range(steps):
        if step == 1:
            ops.logger.reset()  # (the first step also checks the gather order)
        batch = data[step % 16]
        loss = engine(batch[:, :-1], batch[:, 1:])
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
        if step == 1:
            cross.append(ops.logger.cross_node_bytes(NODE))
            groups.append(ops.logger.group_bytes())
    mem = engine.memory_breakdown()
    params = torch.cat([p.detach().reshape(-1) for p in engine.module_state_dict().values()])
    if save is not None:
        engine.save_checkpoint(save, tag="t")
    engine.destroy()
    return {"losses": losses, "cross": cross[0] if cross else None, "groups": groups[0] if groups else None,
            "hpz_secondary": mem.hpz_secondary, "param_bytes": mem.params, "params": params}


def _zeropp_body(rank, world, tmp):
    os.environ["LOCAL_WORLD_SIZE"] = str(NODE)  # the launcher's ranks per node: qgZ alone finds 2 nodes too
    out = {}
    for name, extra in [("plain", PLAIN), ("off", ALL_OFF), ("qw", QW), ("hpz", HPZ), ("qg", QG),
                        ("qg_loco", QG_LOCO), ("all", ALL)]:
        out[name] = _train(rank, extra, min(20, STEPS) if name in ("off", "hpz") else STEPS)  # (hpZ alone: exact)
    out["composed"] = _train(rank, PLAIN, min(30, STEPS), top=COMPOSED)
    out["composed_pp"] = _train(rank, {**ALL, **QG_LOCO}, min(30, STEPS), top=COMPOSED)
    out["frozen"] = _train(rank, PLAIN, min(30, STEPS), freeze=True)
    out["frozen_pp"] = _train(rank, {**ALL, "zero_quantized_nontrainable_weights": True}, min(30, STEPS), freeze=True)
    # checkpoints: ZeRO++ -> plain and plain -> ZeRO++ (the shards' layout is the same)
    _train(rank, ALL, 3, save=os.path.join(tmp, "pp"))
    _train(rank, PLAIN, 3, save=os.path.join(tmp, "plain"))
    out["pp->plain"] = _train(rank, PLAIN, 0, load=os.path.join(tmp, "pp"))["params"]
    out["plain->pp"] = _train(rank, ALL, 0, load=os.path.join(tmp, "plain"))["params"]
    out["pp saved"] = _train(rank, ALL, 0, load=os.path.join(tmp, "pp"))["params"]
    out["plain saved"] = _train(rank, PLAIN, 0, load=os.path.join(tmp, "plain"))["params"]
    return out


@pytest.fixture(scope="module")
def zeropp_runs(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("zeropp"))
    return run_distributed(_zeropp_body, 4, args=(tmp,), timeout=float(os.environ.get("ZEROPP_TEST_TIMEOUT", 300)))


def test_all_off_is_plain_zero3_bitwise(zeropp_runs):
    for r in zeropp_runs:
        assert r["off"]["losses"] == r["plain"]["losses"][:len(r["off"]["losses"])]
        assert r["off"]["hpz_secondary"] == 0


@pytest.mark.parametrize("name", ["qw", "qg", "qg_loco", "all"])
def test_each_part_tracks_zero3_within_one_percent(zeropp_runs, name):
    for r in zeropp_runs:
        plain, got = torch.tensor(r["plain"]["losses"]), torch.tensor(r[name]["losses"])
        rel = ((got - plain).abs() / plain).max()
        assert rel < 0.01, (name, float(rel))
        if len(plain) >= 100:  # (it trained: the 16 batches are learnt)
            assert plain[-10:].mean() < 0.9 * plain[:10].mean()


def test_hpz_alone_is_exact(zeropp_runs):
    """hpZ changes where the backward gathers come from, not the values: losses equal ZeRO-3's."""
    for r in zeropp_runs:
        assert r["hpz"]["losses"] == r["plain"]["losses"][:len(r["hpz"]["losses"])]


def test_cross_node_bytes_drop_below_a_third(zeropp_runs):
    for r in zeropp_runs:
        plain, allpp = r["plain"]["cross"], r["all"]["cross"]
        assert plain > 0 and allpp <= 0.35 * plain, (allpp, plain, allpp / plain)
        # hpZ alone: the backward gathers stay inside the node (node groups are ranks [0-1], [2-3])
        assert r["hpz"]["cross"] < 0.75 * plain
        assert any(g in r["hpz"]["groups"] for g in ("ranks [0-1]", "ranks [2-3]"))


def test_hpz_memory_shows_in_the_breakdown(zeropp_runs):
    r = zeropp_runs[0]
    assert r["plain"]["hpz_secondary"] == 0
    n = r["plain"]["params"].numel()
    assert r["hpz"]["hpz_secondary"] >= n * 4 // NODE  # fp32, a half of every unit per rank


def test_checkpoints_load_across_zeropp_and_plain(zeropp_runs):
    for r in zeropp_runs:
        torch.testing.assert_close(r["pp->plain"], r["pp saved"], rtol=0, atol=0)
        torch.testing.assert_close(r["plain->pp"], r["plain saved"], rtol=0, atol=0)
        assert not torch.equal(r["plain saved"], r["pp saved"])


def test_composes_with_accumulation_clipping_bf16_and_offload(zeropp_runs):
    for r in zeropp_runs:
        plain, got = torch.tensor(r["composed"]["losses"]), torch.tensor(r["composed_pp"]["losses"])
        assert ((got - plain).abs() / plain).max() < 0.02


def test_frozen_weights_kept_quantized(zeropp_runs):
    for r in zeropp_runs:
        plain, got = torch.tensor(r["frozen"]["losses"]), torch.tensor(r["frozen_pp"]["losses"])
        assert ((got - plain).abs() / plain).max() < 0.01
        # the embedding's shard (32 x 16 + 8 x 16 elements over 4 ranks) is held as int8 (+ one scale)
        saved = r["frozen"]["param_bytes"] - r["frozen_pp"]["param_bytes"]
        assert saved >= 3 * (32 * 16 + 8 * 16) // 4 - 8, saved


def test_comms_logger_counts_bytes_per_group_and_across_nodes():
    from shardwise.comm.logger import CommsLogger
    from shardwise.comm.ops import OpRecord

    log = CommsLogger(rank=1)  # rank 1: node 0 of nodes of 2 ranks
    def rec(name, group, size, nbytes):
        r = OpRecord(name, 1, group, size, [], "float32", nbytes, False)
        r.end = r.start + 1e-3
        log.record(r)
    rec("all_gather_into_tensor", "world", 4, 400)  # 100 from each of ranks 2, 3
    rec("reduce_scatter_tensor", "ranks [0-1]", 2, 800)  # inside node 0
    rec("all_to_all_single", "ranks [1,3]", 2, 64)  # 32 from rank 3
    rec("all_reduce", "world", 4, 40)  # 2 * 40 / 4 from each of ranks 2, 3
    rec("broadcast", "ranks [0-1]", 2, 1000)
    assert log.group_bytes() == {"world": 440, "ranks [0-1]": 1800, "ranks [1,3]": 64}
    assert log.cross_node_bytes(2, by_group=True) == {"world": 200 + 40, "ranks [0-1]": 0, "ranks [1,3]": 32}
    assert log.cross_node_bytes(2) == 272
    assert log.cross_node_bytes(4) == 0  # one node
    assert log.cross_node_bytes(1) == 300 + 800 // 2 + 32 + 60 + 1000  # every peer on another node
