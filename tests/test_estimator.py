"""Memory estimator: the formulas for a table of cases, offload placement, the CLI (also from a
Hugging Face config folder), and agreement within 10% with the engine's measured breakdown."""

from __future__ import annotations

import json
import os
import sys

import pytest

from distributed import run_distributed, run_subtests

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (Ψ, N, stage, precision) -> bytes per rank, written from the ZeRO paper's formulas
FORMULA_CASES = [
    (7_500_000_000, 64, 0, "fp16", lambda p, n: 16 * p),
    (7_500_000_000, 64, 1, "bf16", lambda p, n: 4 * p + 12 * p / n),
    (7_500_000_000, 64, 2, "fp16", lambda p, n: 2 * p + 14 * p / n),
    (7_500_000_000, 64, 3, "bf16", lambda p, n: 16 * p / n),
    (1_000_000, 8, 2, "bf16", lambda p, n: 2 * p + 14 * p / n),
    (6_000_000, 1, 3, "fp16", lambda p, n: 16 * p),
    (4_000_000, 4, 0, "fp32", lambda p, n: 16 * p),  # 4Ψ params + 4Ψ grads + 8Ψ Adam states
    (4_000_000, 4, 1, "fp32", lambda p, n: 8 * p + 8 * p / n),
    (4_000_000, 4, 2, "fp32", lambda p, n: 4 * p + 12 * p / n),
    (4_000_000, 4, 3, "fp32", lambda p, n: 16 * p / n),
]


@pytest.mark.parametrize("psi,n,stage,precision,formula", FORMULA_CASES)
def test_model_states_equal_the_formulas(psi, n, stage, precision, formula):
    from shardwise.profiling import estimate_model_states

    for gpus, nodes in ((n, 1), (1, n)) if n > 1 else ((1, 1),):
        est = estimate_model_states(psi, num_gpus=gpus, num_nodes=nodes, stage=stage, precision=precision)
        assert est.dp_world_size == n
        assert est.total == est.device == formula(psi, n)
        assert est.host == est.nvme == 0


def test_offload_moves_optimizer_states_and_params_off_the_device():
    from shardwise.profiling import estimate_model_states

    p, n = 8_000_000, 8
    e = estimate_model_states(p, num_gpus=n, stage=2, precision="bf16", offload_optimizer="cpu")
    assert e.device == 2 * p + 2 * p / n  # 16-bit weights + this rank's gradient partition
    assert e.host == 12 * p / n + 4 * p / n  # master + Adam states + fp32 gradient partition
    assert e.host_per_node == n * e.host
    e = estimate_model_states(p, num_gpus=n, stage=3, precision="bf16", offload_optimizer="nvme", offload_param="cpu")
    assert e.device == 2 * p / n and e.nvme == 12 * p / n and e.host == 2 * p / n + 4 * p / n
    e = estimate_model_states(p, num_gpus=n, stage=1, precision="fp16", offload_optimizer="cpu")
    assert e.device == 4 * p and e.host == 16 * p / n
    for bad, match in (({"stage": 0, "offload_optimizer": "cpu"}, "needs ZeRO stage 1, 2 or 3"),
                       ({"stage": 2, "offload_param": "cpu"}, "needs ZeRO stage 3"),
                       ({"stage": 4}, "stage must be one of"), ({"precision": "fp8"}, "precision must be one of")):
        with pytest.raises(ValueError, match=match):
            estimate_model_states(p, **bad)


def test_tensor_and_pipeline_sizes_divide_the_model_before_zero_partitions_it():
    from shardwise.profiling import estimate_model_states

    p = 8_000_000
    e = estimate_model_states(p, num_gpus=8, stage=3, precision="bf16", tensor_parallel=2)
    assert (e.dp_world_size, e.tensor_parallel) == (4, 2) and e.total == 16 * p / (2 * 4)
    e = estimate_model_states(p, num_gpus=8, stage=1, precision="bf16", tensor_parallel=2, pipeline_parallel=2)
    assert e.dp_world_size == 2 and e.total == 4 * p / 4 + 12 * p / (4 * 2)
    with pytest.raises(ValueError, match=r"tensor_parallel 4 x pipeline_parallel 1 does not divide the 6 ranks"):
        estimate_model_states(p, num_gpus=6, stage=3, tensor_parallel=4)


def test_activation_estimate_follows_the_transformer_formula():
    from shardwise.profiling import estimate_activations

    s, b, h, a, layers = 2048, 2, 4096, 32, 32
    per_layer = s * b * h * (34 + 5 * a * s / h)
    assert estimate_activations(seq_len=s, micro_batch=b, hidden_size=h, num_layers=layers, num_heads=a) == \
        int(layers * per_layer)
    ckpt = estimate_activations(seq_len=s, micro_batch=b, hidden_size=h, num_layers=layers, num_heads=a,
                                checkpointing=True)
    assert ckpt == int(layers * 2 * s * b * h + per_layer)
    assert ckpt < layers * per_layer / 10


def test_cli_from_params_and_from_a_hugging_face_config_folder(tmp_path, capsys):
    import transformers

    from shardwise.cli import main

    assert main(["estimate", "--params", "6.2e9", "--num_gpus", "8", "--stage", "2", "--offload", "none"]) == 0
    out = capsys.readouterr().out
    expected = (2 * 6.2e9 + 14 * 6.2e9 / 8) / 2**30
    assert "6,200,000,000 trainable parameters" in out and f"{expected:.2f} GiB" in out

    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=120, n_positions=32)
    cfg.save_pretrained(tmp_path)
    psi = sum(p.numel() for p in transformers.GPT2LMHeadModel(cfg).parameters())
    assert main(["estimate", "--model", str(tmp_path), "--num_gpus", "2", "--stage", "3", "--offload", "none",
                 "--micro_batch", "4"]) == 0
    out = capsys.readouterr().out
    assert f"{psi:,} trainable parameters" in out
    assert "Activations per rank (seq 32, micro-batch 4, hidden 64, 2 layers, 4 heads)" in out
    with pytest.raises(SystemExit):
        main(["estimate", "--model", str(tmp_path / "missing")])
    assert "no config.json" in capsys.readouterr().err


def _gpt_model(seed: int = 0):
    import torch

    sys.path.insert(0, os.path.join(ROOT, "examples", "gpt"))
    try:
        from model import GPT, GPTConfig
    finally:
        sys.path.pop(0)
    torch.manual_seed(seed)
    return GPT(GPTConfig())


def _accepted_stages() -> list[int]:
    from shardwise.config import ConfigError, load_config

    ok = []
    for stage in range(4):
        try:
            load_config({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": stage}}).check_supported()
            ok.append(stage)
        except ConfigError:
            pass
    return ok


def _measure(case, rank: int, world: int):
    import torch

    import shardwise
    from shardwise.profiling import estimate_from_model

    stage, precision = case
    model = _gpt_model()
    est = estimate_from_model(model, num_gpus=world, stage=stage, precision=precision)
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "zero_optimization": {"stage": stage, "reduce_bucket_size": 100_000},
           "bf16": {"enabled": precision == "bf16"}}
    engine, *_ = shardwise.initialize(model=model, config=cfg)
    idx = torch.randint(0, 128, (2, 65), generator=torch.Generator().manual_seed(rank))
    logits = engine(idx[:, :-1])
    engine.backward(torch.nn.functional.cross_entropy(logits.reshape(-1, 128).float(), idx[:, 1:].reshape(-1)))
    engine.step()  # optimizer states exist after the first step
    return est.as_dict(), engine.memory_breakdown().as_dict()


def _cross_check(rank: int, world: int, stages: list[int]):
    return run_subtests(_measure, [(s, p) for s in stages for p in ("fp32", "bf16")], rank, world)


def test_estimate_within_10_percent_of_the_engines_measured_breakdown():
    stages = _accepted_stages()
    assert 0 in stages
    results = run_distributed(_cross_check, 2, args=(stages,), timeout=180)
    cases = [(s, p) for s in stages for p in ("fp32", "bf16")]
    for rank_results in results:
        for (stage, precision), (est, measured) in zip(cases, rank_results):
            where = f"stage {stage}, {precision}: estimate {json.dumps(est)} vs measured {json.dumps(measured)}"
            assert est["num_params"] == measured["num_params"], where
            assert est["total"] == pytest.approx(measured["total"], rel=0.10), where
            for key in ("params", "grads", "master_params", "optimizer_states"):
                assert est[key] == pytest.approx(measured[key], rel=0.10, abs=0), f"{key}: {where}"
