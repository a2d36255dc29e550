"""``shardwise consolidate``: a ZeRO-3 checkpoint of a Hugging Face model (bf16 training, tied
embeddings, two ranks) becomes fp32 safetensors shards + index equal to the live fp32 weights,
and a folder ``AutoModelForCausalLM.from_pretrained`` loads; streaming keeps memory bounded."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from ckpt_common import full_params
from distributed import run_distributed


def _gpt2(seed=0):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=96, n_positions=16, n_embd=32, n_layer=2, n_head=2, tie_word_embeddings=True)
    return GPT2LMHeadModel(cfg)


def _train_and_save(rank, world, root):
    import shardwise

    model = _gpt2()
    if rank == 0:
        model.config.save_pretrained(os.path.join(root, "hf"))
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
              "bf16": {"enabled": True},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "reduce_bucket_size": 500}}
    engine, *_ = shardwise.initialize(model=model, config=config)
    g = torch.Generator().manual_seed(rank)
    for _ in range(3):
        ids = torch.randint(0, 96, (2, 16), generator=g)
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
    engine.save_checkpoint(os.path.join(root, "ckpt"))
    return full_params(engine)


def test_consolidate_equals_live_weights_and_exports_a_hugging_face_folder(tmp_path):
    from transformers import AutoModelForCausalLM

    from shardwise.cli import main

    live = run_distributed(_train_and_save, 2, args=(str(tmp_path),), timeout=240)[0]
    out = tmp_path / "out"
    assert main(["consolidate", str(tmp_path / "ckpt"), str(out), "--hf-config", str(tmp_path / "hf"),
                 "--max-shard-size", "40KB"]) == 0
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 3 and files == sorted(p.name for p in out.glob("model-*.safetensors"))
    merged = {}
    for f in files:
        tensors = load_file(str(out / f))
        assert os.path.getsize(out / f) <= 40_000 + 4096 or len(tensors) == 1, f"{f} exceeds the shard size"
        merged.update(tensors)
    assert set(merged) == set(index["weight_map"])
    params = {n: v for n, v in live.items() if n in merged}
    assert set(live) - set(params) <= {n for n in live if n.endswith(("attn.bias", "masked_bias"))}
    for name, value in params.items():
        assert merged[name].dtype == torch.float32 and torch.equal(merged[name], value), name
    # Tied output layer: present under its own name, equal to the embedding.
    assert torch.equal(merged["lm_head.weight"], live["transformer.wte.weight"])
    # And a plain Hugging Face model loads it.
    hf = AutoModelForCausalLM.from_pretrained(str(out))
    state = hf.state_dict()
    for name, value in params.items():
        assert torch.equal(state[name], value), name
    assert hf.lm_head.weight.data_ptr() == hf.transformer.wte.weight.data_ptr()
    # Errors: a tag that does not exist names the ones that do.
    with pytest.raises(SystemExit) as e:
        main(["consolidate", str(tmp_path / "ckpt"), str(tmp_path / "x"), "--tag", "nope"])
    assert e.value.code == 2


SAVE = r'''
import sys, torch, shardwise
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(12)])
config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
          "bf16": {"enabled": True}, "zero_optimization": {"stage": 2, "reduce_bucket_size": 3000000}}
engine, *_ = shardwise.initialize(model=model, config=config)
engine.backward(engine(torch.randn(2, 1024).bfloat16()).float().pow(2).mean())
engine.step()
engine.save_checkpoint(sys.argv[1])
'''

CONSOLIDATE = r'''
import resource, sys
from shardwise.checkpoint import consolidate_checkpoint
import torch, safetensors.torch  # imported before the baseline
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
consolidate_checkpoint(sys.argv[1], sys.argv[2], max_shard_size="8MB")
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)
'''


def test_consolidation_streams_with_bounded_memory(tmp_path):
    """fp32 weights are 50 MB; one parameter is 4 MB and a shard at most 8 MB: peak memory must grow
    by far less than the whole state dict."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-c", SAVE, str(tmp_path / "ckpt")], check=True, env=env, timeout=180)
    done = subprocess.run([sys.executable, "-c", CONSOLIDATE, str(tmp_path / "ckpt"), str(tmp_path / "out")],
                          check=True, env=env, timeout=180, capture_output=True, text=True)
    grew_mb = int(done.stdout.split()[-1]) / 1024  # ru_maxrss is in KiB on Linux
    full_mb = 12 * (1024 * 1024 + 1024) * 4 / 2**20
    assert grew_mb < 0.5 * full_mb, f"peak RSS grew by {grew_mb:.1f} MB; the whole fp32 state is {full_mb:.1f} MB"
    shards = sorted((tmp_path / "out").glob("model-*.safetensors"))
    assert len(shards) >= 6 and max(p.stat().st_size for p in shards) <= 8_000_000 + 4096
