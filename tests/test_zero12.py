"""ZeRO stages 1 and 2 reproduce single-process training (fp32, tight tolerance)."""

from __future__ import annotations


from distributed import run_distributed
from models import base_config, make_model, reference_training
from test_engine_dp import GLOBAL_BATCH, STEPS, _assert_close, _train_shardwise

# Tiny buckets: TinyMLP's parameters spread over several buckets, each padded to the world size.
ZERO = {"reduce_bucket_size": 40, "allgather_bucket_size": 60}


def _cases(world: int):
    micro = GLOBAL_BATCH // world
    for stage in (1, 2):
        z = {"stage": stage, **ZERO}
        yield f"s{stage}", base_config(train_micro_batch_size_per_gpu=micro, zero_optimization=z)
        yield f"s{stage}_clip", base_config(train_micro_batch_size_per_gpu=micro, gradient_clipping=0.05,
                                            zero_optimization=z)
        yield f"s{stage}_one_bucket", base_config(train_micro_batch_size_per_gpu=micro,
                                                  zero_optimization={"stage": stage})
        # "reduce_scatter": false reduces with all-reduce and keeps this rank's chunk.
        yield f"s{stage}_allreduce", base_config(train_micro_batch_size_per_gpu=micro,
                                                 zero_optimization={**z, "reduce_scatter": False})


def _body(rank: int, world: int):
    out = {name: _train_shardwise(rank, world, cfg) for name, cfg in _cases(world)}
    import shardwise

    engine, *_ = shardwise.initialize(model=make_model(), config=base_config(
        train_micro_batch_size_per_gpu=GLOBAL_BATCH // world, zero_optimization={"stage": 2, **ZERO}))
    owned = sum(t.numel() for t in engine.strategy.master_named_params().values())
    padded = sum(g.padded_numel for g in engine.strategy.groups)
    out["owned"] = (owned, padded)
    return out


def _check(results, world):
    ref = reference_training(STEPS, GLOBAL_BATCH)
    ref_clip = reference_training(STEPS, GLOBAL_BATCH, clip=0.05)
    for name in results[0]:
        if name == "owned":
            continue
        for r in results[1:]:
            _assert_close(results[0][name], r[name], exact=True)  # every replica identical
        _assert_close(results[0][name], ref_clip if name.endswith("clip") else ref)
    # Each rank owns 1/N of the (padded) optimizer partition.
    for r in results:
        owned, padded = r["owned"]
        assert owned <= padded // world and owned > 0


def test_stage1_and_stage2_match_single_process_two_ranks():
    _check(run_distributed(_body, 2, timeout=300), 2)


def test_stage1_and_stage2_match_single_process_four_ranks():
    _check(run_distributed(_body, 4, timeout=300), 4)


def _accum_body(rank: int, world: int):
    # Global batch 12 = world x micro-batch x accumulation 3.
    out = {}
    for stage in (1, 2):
        out[stage] = _train_shardwise(rank, world, base_config(
            train_micro_batch_size_per_gpu=12 // world // 3, gradient_accumulation_steps=3,
            zero_optimization={"stage": stage, **ZERO}), global_batch=12)
    return out


def test_accumulation_three_matches_single_process_two_and_four_ranks():
    ref = reference_training(STEPS, 12)
    for world in (2, 4):
        results = run_distributed(_accum_body, world, timeout=300)
        for stage in (1, 2):
            _assert_close(results[0][stage], ref)
            for r in results[1:]:
                _assert_close(results[0][stage], r[stage], exact=True)


def test_stage1_and_stage2_with_the_backends_own_collectives_two_ranks():
    """On gloo shardwise exchanges chunks point to point (shardwise.comm.direct); this runs
    gloo's own reduce-scatter and all-gather instead."""
    _check(run_distributed(_body, 2, timeout=300, env={"SHARDWISE_DIRECT_COLLECTIVES": "0"}), 2)
