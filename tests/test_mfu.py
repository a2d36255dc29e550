"""Tokens per second and MFU: the arithmetic, the peak table, and the figures in the steps_per_print line,
the progress bar and the monitors of a real 2-rank run (the token count includes both replicas)."""

from __future__ import annotations

import csv
import logging
import os

import pytest
import torch

from distributed import run_distributed, run_subtests

GPT_KW = dict(vocab_size=64, seq_len=16, hidden=32, n_layers=2, n_heads=4)


def test_peak_table_and_overrides(monkeypatch):
    from shardwise.monitor.mfu import peak_flops

    monkeypatch.delenv("SHARDWISE_PEAK_TFLOPS", raising=False)
    assert peak_flops("NVIDIA H100 80GB HBM3", "bf16")[0] == pytest.approx(989.4e12)
    assert peak_flops("NVIDIA H100 PCIe", "bf16")[0] == pytest.approx(756e12)
    assert peak_flops("NVIDIA H200", "fp16")[0] == pytest.approx(989.4e12)
    assert peak_flops("NVIDIA A100-SXM4-80GB", "fp32")[0] == pytest.approx(19.5e12)
    assert peak_flops("AMD Instinct MI300X", "bf16")[0] == pytest.approx(1307.4e12)
    assert peak_flops("NVIDIA A100-SXM4-80GB", "bf16", override_tflops=100)[0] == pytest.approx(100e12)
    none, why = peak_flops(None, "fp32")
    assert none is None and "no accelerator" in why and "peak_tflops" in why
    none, why = peak_flops("Tesla V100-SXM2-16GB", "bf16")
    assert none is None and "no bf16 peak known" in why
    monkeypatch.setenv("SHARDWISE_PEAK_TFLOPS", "50")
    assert peak_flops(None, "fp32") == (50e12, "SHARDWISE_PEAK_TFLOPS")


def test_model_flops_is_6n_plus_attention():
    from shardwise.models.gpt import GPT, GPTConfig
    from shardwise.monitor.mfu import model_flops

    cfg = GPTConfig(**GPT_KW)
    model = GPT(cfg)
    tables = sum(m.weight.numel() for m in model.modules() if type(m).__name__ in ("VocabParallelEmbedding", "Embedding")
                 or isinstance(m, torch.nn.Embedding))
    n = sum(p.numel() for p in model.parameters()) - tables
    f = model_flops(model)
    assert (f.matmul_params, f.layers, f.heads, f.head_dim) == (n, 2, 4, 8)
    assert f.per_token(16) == 6 * n + 12 * 2 * 4 * 8 * 16


def test_hf_model_flops_reads_the_config():
    transformers = pytest.importorskip("transformers")
    from shardwise.monitor.mfu import model_flops

    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=256, tie_word_embeddings=False)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    f = model_flops(model)
    total = sum(p.numel() for p in model.parameters())
    assert f.matmul_params == total - 256 * 64  # the input embedding is a table; the LM head is a matmul
    assert (f.layers, f.heads, f.head_dim) == (2, 4, 16)


def test_meter_arithmetic():
    from shardwise.monitor.mfu import ModelFlops, ThroughputMeter, format_rates

    flops = ModelFlops(1000, layers=2, heads=4, head_dim=8)
    m = ThroughputMeter(flops, replicas=4, world=8, peak=1e9, peak_source="test")
    assert m.rates("k", now=10.0)["why"] == "first interval"
    ids = torch.zeros(3, 16, dtype=torch.long)
    for _ in range(2):  # two micro-batches of 3 x 16 tokens on this rank
        m.observe((ids,), {})
    m.step_done()
    r = m.rates("k", now=12.0)
    tokens = 2 * 3 * 16 * 4  # x 4 data-parallel replicas
    assert r["tokens_per_sec"] == pytest.approx(tokens / 2.0)
    assert r["mfu"] == pytest.approx(tokens * flops.per_token(16) / 2.0 / (8 * 1e9))
    assert format_rates(r) == f", tokens/sec={tokens / 2.0:.1f}, MFU={100 * r['mfu']:.1f}%"
    m.observe((), {"input_ids": torch.zeros(1, 4, dtype=torch.int32)})  # by keyword
    assert m._pending == 4
    plain = ThroughputMeter(flops, replicas=1, world=1, peak=None, peak_source="no accelerator")
    plain.observe((torch.randn(2, 3),), {})  # floats: not token ids
    assert plain.rates("k")["why"].startswith("no token ids")


def test_progress_bar_shows_tokens_and_mfu(capsys):
    from shardwise.runtime.progress import ProgressBar

    with ProgressBar(total=2, enabled=True) as bar:
        bar.update(step=1, loss=1.0, lr=0.1, samples=8, rates={"tokens_per_sec": 1234.0, "mfu": 0.412})
    err = capsys.readouterr().err
    assert "tokens/s=1234" in err and "MFU=41.2%" in err


def _train(case, rank, world, root):
    import shardwise
    from shardwise.models.gpt import GPT, GPTConfig, gpt_loss

    name, peak = case
    cfg = GPTConfig(**GPT_KW)
    torch.manual_seed(0)
    out = os.path.join(root, name)
    ds = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "steps_per_print": 2,
          "optimizer": {"type": "SGD", "params": {"lr": 0.01}},
          "csv_monitor": {"enabled": True, "output_path": out, "job_name": "j"}}
    if peak:
        ds["peak_tflops"] = peak
    engine, *_ = shardwise.initialize(model=GPT(cfg), config=ds)
    records = []
    handler = logging.Handler()
    handler.emit = lambda rec: records.append(rec.getMessage())
    logging.getLogger("shardwise").addHandler(handler)
    g = torch.Generator().manual_seed(rank)
    try:
        for _ in range(4 * 2):
            ids = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len), generator=g)
            engine.backward(gpt_loss(engine(ids), ids))
            engine.step()
    finally:
        logging.getLogger("shardwise").removeHandler(handler)
    engine.monitor.close()
    return {"lines": [r for r in records if r.startswith("step=") or r.startswith("MFU not shown")], "out": out}


def _body(rank, world, root):
    return run_subtests(_train, [("peak", 1e-6), ("cpu", None)], rank, world, root)


def test_steps_per_print_progress_and_monitors_show_tokens_and_mfu(tmp_path):
    from shardwise.models.gpt import GPT, GPTConfig
    from shardwise.monitor.mfu import model_flops

    r0, _ = run_distributed(_body, 2, args=(str(tmp_path),), timeout=300)
    with_peak, cpu = r0
    steps = [line for line in with_peak["lines"] if line.startswith("step=")]
    assert len(steps) == 2  # steps 2 and 4
    assert "tokens/sec=" in steps[1] and "MFU=" in steps[1]
    tokens_per_sec = float(steps[1].split("tokens/sec=")[1].split(",")[0])
    mfu = float(steps[1].split("MFU=")[1].split("%")[0]) / 100
    per_token = model_flops(GPT(GPTConfig(**GPT_KW))).per_token(GPT_KW["seq_len"])
    # MFU = FLOPs per token x tokens/s / (2 ranks x 1e-6 TFLOP/s), to the printed precision
    assert mfu == pytest.approx(per_token * tokens_per_sec / (2 * 1e6), rel=2e-3)
    cpu_steps = [line for line in cpu["lines"] if line.startswith("step=")]
    assert "tokens/sec=" in cpu_steps[1] and "MFU=" not in cpu_steps[1]
    assert [line for line in cpu["lines"] if line.startswith("MFU not shown")] == \
        ["MFU not shown: no accelerator (set peak_tflops in the config for an MFU figure)"]
    for name, expect_mfu in (("peak", True), ("cpu", False)):
        folder = os.path.join(str(tmp_path), name, "j")
        files = set(os.listdir(folder))
        assert "Train_Samples_tokens_per_sec.csv" in files
        assert ("Train_Samples_mfu.csv" in files) == expect_mfu
        with open(os.path.join(folder, "Train_Samples_tokens_per_sec.csv"), newline="") as f:
            rows = list(csv.reader(f))[1:]
        # 2 ranks x 2 micro-batches x 2 x 16 tokens = 128 tokens a step, from the second step on
        assert len(rows) == 3 and all(float(v) > 0 for _, v in rows)
