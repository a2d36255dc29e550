"""DeepSpeed helpers that its own unit tests drive directly, through the compat package (compat/deepspeed):
the RL rollout interface (``deepspeed.runtime.rollout``) generating through shardwise's hybrid engine,
ZenFlow's config block, ``DeepSpeedFP16Config``'s numeric-string loss scale, the fused expert layout
classifier, the autotuner's ``ResourceManager`` / ``get_val_by_key``; and the shardwise behaviour under them
(``shardwise.runtime.rollout``, the autotuner's nested ``arg_mappings``).

The compat checks run in one subprocess (the compat package's import hook stays out of this process); the
hybrid-engine rollout runs in one single-rank process of tests/distributed.py.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from compat_venv import run_compat_probe
from distributed import run_distributed

REPO = Path(__file__).resolve().parents[1]
COMPAT = REPO / "compat" / "deepspeed"


def _tiny_opt(seed: int = 0):
    from transformers import OPTConfig, OPTForCausalLM

    torch.manual_seed(seed)
    cfg = OPTConfig(vocab_size=48, hidden_size=16, num_hidden_layers=2, ffn_dim=32, num_attention_heads=2,
                    max_position_embeddings=32, word_embed_proj_dim=16, dropout=0.0, attention_dropout=0.0,
                    pad_token_id=1, bos_token_id=2, eos_token_id=47)
    return OPTForCausalLM(cfg).eval()


# ----------------------------------------------------------------------------------- shardwise side

def test_pad_after_eos_keeps_the_first_eos_and_pads_the_rest():
    from shardwise.runtime.rollout import pad_after_eos

    ids = torch.tensor([[5, 6, 9, 7, 9, 8],    # eos (9) at response column 0 and 2
                        [5, 6, 3, 4, 8, 8],    # no eos
                        [0, 6, 4, 9, 0, 3]])   # eos at response column 1; a pad (0) before it
    out, mask = pad_after_eos(ids, 2, eos_token_id=9, pad_token_id=0)
    assert out.tolist() == [[5, 6, 9, 0, 0, 0], [5, 6, 3, 4, 8, 8], [0, 6, 4, 9, 0, 0]]
    assert mask.tolist() == [[1, 0, 0, 0], [1, 1, 1, 1], [1, 1, 0, 0]]
    assert ids[0, 3] == 7  # the input is left alone
    # eos == pad: the first one still counts as a response token; several eos ids; no eos id at all
    out, mask = pad_after_eos(torch.tensor([[1, 4, 0, 5, 0]]), 1, eos_token_id=0, pad_token_id=0)
    assert out.tolist() == [[1, 4, 0, 0, 0]] and mask.tolist() == [[1, 1, 0, 0]]
    out, mask = pad_after_eos(torch.tensor([[1, 3, 8, 4]]), 1, eos_token_id=[8, 3], pad_token_id=0)
    assert out.tolist() == [[1, 3, 0, 0]] and mask.tolist() == [[1, 0, 0]]
    out, mask = pad_after_eos(torch.tensor([[1, 3, 0, 4]]), 1, eos_token_id=None, pad_token_id=0)
    assert out.tolist() == [[1, 3, 0, 4]] and mask.tolist() == [[1, 0, 1]]


def test_rollout_repeats_prompts_runs_every_step_and_cuts_at_eos():
    pytest.importorskip("transformers")
    from shardwise.runtime.rollout import rollout

    model = _tiny_opt()
    prompts = torch.tensor([[1, 1, 5, 6], [7, 8, 9, 10]])  # left-padded (pad 1)
    attn = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    new = 6
    ref = model.generate(prompts.repeat_interleave(2, 0), attention_mask=attn.repeat_interleave(2, 0),
                         max_new_tokens=new, eos_token_id=None, do_sample=False, pad_token_id=1)
    assert ref.shape == (4, 4 + new)
    eos = int(ref[0, 4 + 2])  # a token the greedy response of the first prompt produces at step 3
    ids, mask, start = rollout(SimpleNamespace(module=model), prompts, attn, max_new_tokens=new, pad_token_id=1,
                               eos_token_id=eos, temperature=0.0, n_samples=2)
    assert start == 4 and ids.shape == mask.shape == (4, 4 + new)
    assert torch.equal(ids[:, :4], prompts.repeat_interleave(2, 0))
    assert torch.equal(mask[:, :4], attn.repeat_interleave(2, 0))
    for row in range(4):
        resp, want = ids[row, 4:].tolist(), ref[row, 4:].tolist()
        cut = want.index(eos) if eos in want else new
        assert resp[:cut + 1] == want[:cut + 1]  # the generation itself, up to and with the first eos
        assert resp[cut + 1:] == [1] * (new - cut - 1)  # then padding
        kept = [int(t != 1 or (i == cut and t == eos)) for i, t in enumerate(want[:cut + 1])]
        assert mask[row, 4:].tolist() == kept + [0] * (new - cut - 1)
    assert ids[0, 4 + 3:].eq(1).all()  # the first sample was cut after its eos
    # sampling: every row still gets max_new_tokens columns; top_k / top_p reach generate
    torch.manual_seed(0)
    ids, mask, _ = rollout(SimpleNamespace(module=model), prompts, attn, max_new_tokens=3, pad_token_id=1,
                           eos_token_id=None, temperature=0.7, top_p=0.9, top_k=5)
    assert ids.shape == (2, 7)
    with pytest.raises(ValueError, match="2-D"):
        rollout(SimpleNamespace(module=model), prompts[0], attn[0], max_new_tokens=3, pad_token_id=1)


def test_response_targets_and_generalized_jsd():
    from shardwise.runtime.rollout import generalized_jsd, response_targets

    ids = torch.tensor([[0, 5, 6, 7, 8], [4, 5, 6, 7, 1]])
    attn = torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 0]])
    targets, mask = response_targets(ids, attn, torch.tensor([3, 2]))
    assert torch.equal(targets, ids[:, 1:])
    assert mask.tolist() == [[False, False, True, True], [False, True, True, False]]

    torch.manual_seed(0)
    s, t = torch.randn(2, 4, 7), torch.randn(2, 4, 7)
    S, T = torch.softmax(s, -1), torch.softmax(t, -1)

    def kl(p, q):  # per position, summed over the vocabulary
        return (p * (p.log() - q.log())).sum(-1)

    def masked_mean(x):
        return (x * mask).sum() / mask.sum()

    loss, total, count = generalized_jsd(s, t, mask, beta=0.0)
    assert count == 4 and torch.allclose(loss, masked_mean(kl(T, S)), atol=1e-6) and torch.allclose(total, loss * 4)
    assert torch.allclose(generalized_jsd(s, t, mask, beta=1.0)[0], masked_mean(kl(S, T)), atol=1e-6)
    M = 0.3 * T + 0.7 * S
    want = masked_mean(0.3 * kl(T, M) + 0.7 * kl(S, M))
    assert torch.allclose(generalized_jsd(s, t, mask, beta=0.3)[0], want, atol=1e-6)
    assert torch.allclose(generalized_jsd(s, t, mask, beta=0.5)[0], generalized_jsd(t, s, mask, beta=0.5)[0], atol=1e-6)
    # temperature; the teacher's top-k (both renormalised over those tokens); the pointwise cap
    assert torch.allclose(generalized_jsd(s, t, mask, beta=0.0, temperature=2.0)[0],
                          masked_mean(kl(torch.softmax(t / 2, -1), torch.softmax(s / 2, -1))), atol=1e-6)
    keep = t.topk(3, -1).indices
    Sk, Tk = torch.softmax(s.gather(-1, keep), -1), torch.softmax(t.gather(-1, keep), -1)
    assert torch.allclose(generalized_jsd(s, t, mask, beta=0.0, teacher_top_k=3)[0], masked_mean(kl(Tk, Sk)),
                          atol=1e-6)
    capped = masked_mean((T * (T.log() - S.log())).clamp(max=0.01).sum(-1))
    assert torch.allclose(generalized_jsd(s, t, mask, beta=0.0, pointwise_clip=0.01)[0], capped, atol=1e-6)
    assert generalized_jsd(s, t, torch.zeros_like(mask), beta=0.5)[0] == 0  # no response token: 0, not NaN


def test_autotune_arg_mappings_find_nested_keys_and_skip_auto():
    from shardwise.autotuning.runner import TrialRunner, clean_arg_mappings, config_value
    from shardwise.launcher.options import LaunchOptions

    cfg = {"optimizer": {"type": "Adam"}, "zero_optimization": {"offload_optimizer": {"device": "cpu"}},
           "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": "auto"}
    assert config_value(cfg, "device") == "cpu" and config_value(cfg, "type") == "Adam"
    assert config_value(cfg, "missing") is None
    assert clean_arg_mappings({" a ": " --x ", "a": "--y"}) == {"a": "--x"}
    runner = TrialRunner(opts=LaunchOptions(script="train.py", script_args=["--deepspeed_config", "c.json", "--mb", "1"]),
                         exps_dir="/tmp", timeout=1, arg_mappings={
                             " train_micro_batch_size_per_gpu": "--mb ", "device": "--offload",
                             "gradient_accumulation_steps": "--gas"})
    cmd = runner.command("/tmp/exp.json", cfg)
    args = cmd[cmd.index("train.py") + 1:]
    assert args == ["--deepspeed_config", "/tmp/exp.json", "--mb", "4", "--offload", "cpu"]  # no --gas for "auto"


def _selective_run(opt_cls, weight, grads, cols, *, partitioned=False, offload=False):
    """Steps of ``opt_cls`` on ``weight`` updating columns ``cols`` with the matching columns of ``grads``."""
    p = torch.nn.Parameter(weight.clone())
    if partitioned:  # ZenFlow's ZeRO-3 layout: the rank's partition holds the weight transposed
        p.ds_shape, p.ds_tensor = (weight.shape[1], weight.shape[0]), weight.t().contiguous().view(-1).clone()
        p.complete_column_offset, p.complete_numel, p.group_id = 0, weight.numel(), 0
    opt = opt_cls([p], lr=0.1, weight_decay=0.05, offload=offload, bucket_size=1)
    for g in grads:
        p.selected_indices = cols
        p.selected_grad = g[:, cols].t().contiguous() if partitioned else g[:, cols].clone()
        if offload:
            shape = p.selected_grad.shape
            if not hasattr(p, "exp_avg_cpu_data"):
                p.exp_avg_cpu_data, p.exp_avg_sq_cpu_data = torch.zeros(shape), torch.zeros(shape)
            p.exp_avg, p.exp_avg_sq = p.exp_avg_cpu_data.clone(), p.exp_avg_sq_cpu_data.clone()
        opt.temp_copy_param([p] if partitioned else {0: [p]})
        opt.step()
        assert p.selected_grad is None and getattr(p, "temp_selected_param", None) is None
    return p.ds_tensor.view(p.ds_shape).t() if partitioned else p.data


def test_selective_adamw_updates_the_selected_columns_as_adamw_does():
    """ZenFlow's selective AdamW (shardwise.optim.selective_adam): with every column selected it is
    torch's AdamW; otherwise the selected columns move as AdamW moves them and the rest stay; the ZeRO-3
    partition layout (transposed) and the host-moment (offload) path give the same weights."""
    from shardwise.optim.selective_adam import PartitionedSelectiveAdamW, SelectiveAdamW

    torch.manual_seed(0)
    weight = torch.randn(3, 5)
    grads = [torch.randn(3, 5) for _ in range(4)]
    ref = torch.nn.Parameter(weight.clone())
    adam = torch.optim.AdamW([ref], lr=0.1, weight_decay=0.05)
    for g in grads:
        ref.grad = g.clone()
        adam.step()
    every = torch.arange(5)
    assert torch.allclose(_selective_run(SelectiveAdamW, weight, grads, every), ref.data, atol=1e-6)

    cols = torch.tensor([1, 3])
    ref2 = torch.nn.Parameter(weight[:, cols].clone())
    adam2 = torch.optim.AdamW([ref2], lr=0.1, weight_decay=0.05)
    for g in grads:
        ref2.grad = g[:, cols].clone()
        adam2.step()
    out = _selective_run(SelectiveAdamW, weight, grads, cols)
    assert torch.allclose(out[:, cols], ref2.data, atol=1e-6)
    assert torch.equal(out[:, [0, 2, 4]], weight[:, [0, 2, 4]])  # the other columns are not touched
    for kwargs in (dict(offload=True), dict(partitioned=True), dict(partitioned=True, offload=True)):
        cls = PartitionedSelectiveAdamW if kwargs.get("partitioned") else SelectiveAdamW
        assert torch.allclose(_selective_run(cls, weight, grads, cols, **kwargs), out, atol=1e-6), kwargs
    # a 1-D parameter is updated whole
    bias = torch.nn.Parameter(torch.ones(4))
    opt = SelectiveAdamW([bias], lr=0.1)
    bias.selected_indices, bias.selected_grad = torch.arange(4), torch.full((4,), 2.0)
    opt.step()
    assert torch.allclose(bias.data, torch.full((4,), 1 - 0.1 - 0.1 * 0.01))  # AdamW's first step: -lr * sign


# ------------------------------------------------------------------------------------- compat side

_PROBE = r'''
import json, sys, traceback
import torch
from pydantic import ValidationError
results = {}

def check(name):
    def run(fn):
        try:
            fn()
            results[name] = "ok"
        except BaseException:
            results[name] = traceback.format_exc()[-2500:]
    return run

@check("rollout_interface")
def _():
    from deepspeed.runtime.rollout import (RolloutBatch, RolloutEngine, RolloutRequest, SamplingConfig, build_rollout,
                                           HybridEngineRollout)
    from deepspeed.runtime.rollout.base import RolloutConfig
    from deepspeed.runtime.rollout.hybrid_engine_rollout import HybridEngineRolloutConfig
    for kw, msg in ((dict(prompt_ids=torch.zeros(8), prompt_attention_mask=torch.ones(8)), "must be 2-D"),
                    (dict(prompt_ids=torch.zeros(2, 4), prompt_attention_mask=torch.ones(2, 5)), "does not match")):
        try:
            RolloutRequest(**kw)
            raise AssertionError("accepted " + msg)
        except ValueError as e:
            assert msg in str(e), e
    try:
        RolloutBatch(input_ids=torch.zeros(2, 4), attention_mask=torch.ones(2, 4), response_start_idx=torch.tensor([4]))
        raise AssertionError("accepted a short response_start_idx")
    except ValueError as e:
        assert "1-D of length 2" in str(e), e
    b = RolloutBatch(input_ids=torch.zeros(3, 12), attention_mask=torch.ones(3, 12), response_start_idx=torch.tensor([4, 5, 6]))
    assert (b.batch_size, b.seq_len) == (3, 12)
    s = SamplingConfig(max_new_tokens=32)
    assert (s.temperature, s.top_p, s.top_k, s.n_samples_per_prompt, s.continuous_batch_size) == (1.0, 1.0, -1, 1, None)
    for cfg, msg in ((RolloutConfig(engine="nope"), "Unknown rollout engine"), (RolloutConfig(), "needs both")):
        try:
            build_rollout(cfg)
            raise AssertionError("built " + msg)
        except ValueError as e:
            assert msg in str(e), e
    eng, tok = type("Engine", (), {"module": None})(), type("Tok", (), {"pad_token_id": 0, "eos_token_id": 2})()
    r = build_rollout(RolloutConfig(use_graph_capture=True), student_engine=eng, tokenizer=tok)
    assert isinstance(r, HybridEngineRollout) and isinstance(r, RolloutEngine)
    assert r.engine is eng and r.tokenizer is tok and r.use_graph_capture is True and r.sync_weights(3) is None
    assert HybridEngineRolloutConfig().use_graph_capture is False
    assert HybridEngineRollout(eng, tok).use_graph_capture is False
    req = RolloutRequest(prompt_ids=torch.ones(1, 2, dtype=torch.long), prompt_attention_mask=torch.ones(1, 2))
    try:  # CUDA-graph greedy decoding is not implemented: a named error, not a silent other path
        r.generate(req, SamplingConfig(max_new_tokens=2, temperature=0))
        raise AssertionError("graph capture accepted")
    except NotImplementedError as e:
        assert "use_graph_capture" in str(e), e
    from deepspeed.runtime.rollout import JSDLossOutput, ResponseTokenBatch, generalized_jsd_loss
    rb = RolloutBatch(input_ids=torch.tensor([[0, 5, 6, 7]]), attention_mask=torch.tensor([[0, 1, 1, 1]]),
                      response_start_idx=torch.tensor([2]))
    tb = ResponseTokenBatch.from_rollout(rb)
    assert tb.target_ids.tolist() == [[5, 6, 7]] and tb.response_mask.tolist() == [[False, True, True]]
    assert tb.select_causal_logits(torch.zeros(1, 4, 9)).shape == (1, 3, 9)
    for bad, msg in ((torch.tensor([0]), "in [1, sequence_length]"), (torch.tensor([2.0]), "integer dtype")):
        try:
            ResponseTokenBatch.from_rollout(RolloutBatch(rb.input_ids, rb.attention_mask, bad))
            raise AssertionError("accepted " + msg)
        except ValueError as e:
            assert msg in str(e), e
    out = generalized_jsd_loss(torch.zeros(1, 3, 9), torch.zeros(1, 3, 9), tb.response_mask)
    assert isinstance(out, JSDLossOutput) and abs(float(out.loss)) < 1e-6 and int(out.valid_token_count) == 2
    for kw, msg in ((dict(beta=1.5), "beta must be in [0, 1]"), (dict(teacher_top_k=10), "vocabulary size"),
                    (dict(temperature=0), "temperature must be positive")):
        try:
            generalized_jsd_loss(torch.zeros(1, 3, 9), torch.zeros(1, 3, 9), tb.response_mask, **kw)
            raise AssertionError("accepted " + msg)
        except ValueError as e:
            assert msg in str(e), e

@check("zenflow_config")
def _():
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from deepspeed.runtime.zenflow.zenflow_config import ZenFlowConfig
    from deepspeed.runtime.zero.offload_config import DeepSpeedZeroOffloadOptimizerConfig
    c = DeepSpeedZeroConfig(stage=2, offload_optimizer={"device": "cpu"},
                            zenflow={"topk_ratio": 0.3, "select_strategy": "epoch", "update_interval": 6})
    assert isinstance(c.zenflow, ZenFlowConfig) and c.zenflow.topk_ratio == 0.3 and c.zenflow.select_interval == "auto"
    assert c.zenflow.select_strategy == "epoch" and c.zenflow.update_interval == 6 and c.stage == 2
    assert isinstance(c.offload_optimizer, DeepSpeedZeroOffloadOptimizerConfig)
    assert DeepSpeedZeroConfig(stage=1).zenflow is None
    for bad in (123, {"topk_ratio": 1.5}, {"select_strategy": "often"}, {"update_interval": 0}, {"nope": 1}):
        try:
            DeepSpeedZeroConfig(zenflow=bad)
            raise AssertionError(f"accepted zenflow={bad!r}")
        except ValidationError:
            pass
    # the engine does not run ZenFlow: the whole config refuses it by name
    from deepspeed.runtime.config import DeepSpeedConfig
    try:
        DeepSpeedConfig({"train_batch_size": 1, "zero_optimization": {"stage": 2, "zenflow": {"topk_ratio": 0.2}}})
        raise AssertionError("an engine config with ZenFlow was accepted")
    except Exception as e:
        assert "zero_optimization.zenflow" in str(e) and "not implemented" in str(e), e

@check("fp16_loss_scale")
def _():
    from deepspeed.runtime.precision_config import DeepSpeedFP16Config
    assert DeepSpeedFP16Config(loss_scale="3").loss_scale == 3.0
    assert DeepSpeedFP16Config(loss_scale=2).loss_scale == 2.0
    for bad in (-1, float("inf"), True, "x", []):
        try:
            DeepSpeedFP16Config(loss_scale=bad)
            raise AssertionError(f"accepted loss_scale={bad!r}")
        except ValidationError:
            pass
    # the config an engine is built from keeps shardwise's one type rule: a string there is refused by name
    from deepspeed.runtime.config import DeepSpeedConfig
    try:
        DeepSpeedConfig({"train_batch_size": 1, "fp16": {"enabled": True, "loss_scale": "3"}})
        raise AssertionError("a string loss_scale in an engine config was accepted")
    except Exception as e:
        assert "fp16.loss_scale" in str(e), e

@check("fused_expert_layout")
def _():
    from deepspeed.moe.fused_expert_layout import FusedExpertLayout, classify_fused_gate_up_layout as c
    assert c((8, 256, 64), (8, 64, 128)) == FusedExpertLayout("gate_up_first", 64, 128, False)
    assert c((8, 64, 256), (8, 128, 64)) == FusedExpertLayout("hidden_first", 64, 128, True)
    assert c((8, 64, 64), (8, 64, 64)) is None and c((8, 255, 64), (8, 64, 127)) is None and c((64, 64), (64, 64)) is None

@check("autotuning")
def _():
    from deepspeed.autotuning.scheduler import ResourceManager
    from deepspeed.autotuning.utils import get_val_by_key, set_val_by_key
    rm = ResourceManager(args=None, hosts=["worker-0", "worker-1"], num_gpus_per_node=4, results_dir=None,
                         exps_dir=None, arg_mappings={" train_batch_size ": " -tbs", "gradient_accumulation_steps": "--gas"})
    assert rm.arg_mappings == {"train_batch_size": "-tbs", "gradient_accumulation_steps": "--gas"}
    assert [n.host for n in rm.nodes] == ["worker-0", "worker-1"] and rm.nodes[0].idle_slots == [0, 1, 2, 3]
    assert rm.nodes[1].reserve_slots(3) == [0, 1, 2] and rm.nodes[1].reserve_slots(2) is None
    assert ResourceManager(None, [], 1, None, None, None).arg_mappings == {}
    try:
        rm.run()
        raise AssertionError("the scheduler ran")
    except NotImplementedError as e:
        assert "shardwise autotune" in str(e), e
    exp = {"optimizer": {"type": "Adam"}, "zero_optimization": {"offload_optimizer": {"device": "cpu"}}}
    assert get_val_by_key(exp, "device") == "cpu" and get_val_by_key(exp, "missing") is None
    set_val_by_key(exp, "device", "nvme")
    assert exp["zero_optimization"]["offload_optimizer"]["device"] == "nvme"

@check("autotp_partition_config")
def _():
    import re
    import torch.nn as nn
    from deepspeed.module_inject.auto_tp import AutoTP, AutoTPConfig, PartitionType, TPLayerSpec
    from deepspeed.module_inject.layers import LinearAllreduce, LinearLayer, SubParamLinearLayer
    from deepspeed.module_inject.tp_plan_converter import TPPlanConverter

    class Attn(nn.Module):
        def __init__(self):
            super().__init__()
            self.q_proj, self.o_proj, self.qkv = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 24)

        def forward(self, x):
            return self.o_proj(self.q_proj(x)) + self.qkv(x)[..., :8]

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(10, 8)
            self.layers = nn.ModuleList([Attn(), Attn()])
            self.head = nn.Linear(8, 10)

        def forward(self, ids):
            x = self.embed(ids)
            for layer in self.layers:
                x = layer(x)
            return self.head(x)

    torch.manual_seed(0)
    model = Model()
    ids = torch.tensor([[1, 2, 3]])
    want = model(ids)
    cfg = AutoTPConfig.from_dict({"layer_specs": [
        {"patterns": [r".*\.self_attn\.never$"], "partition_type": "row"},
        {"patterns": [r"layers\.\d+\.q_proj\.weight$"], "partition_type": "column"},
        {"patterns": [r"layers\.1\.o_proj\.weight$"], "partition_type": "skip"},
        {"patterns": [r".*\.o_proj\.weight$"], "partition_type": "row"},
        {"patterns": [r".*\.qkv\.weight$"], "partition_type": "column", "shape": [3, -1]},
        {"patterns": [r"head\.weight$"], "partition_type": "column", "gather_output": True, "model_types": ["other"]}]})
    seen = []
    tp = AutoTP(model, [], "model", None, None, None, partition_config=cfg)
    real = AutoTP._replace_with_config
    AutoTP._replace_with_config = lambda self, child, name: (seen.append(name), real(self, child, name))[1]
    try:
        tp.set_tensor_parallel_config(1, None)
        tp.update_linear_policies()
        tp._replace_module(model)
    finally:
        AutoTP._replace_with_config = real
    assert seen == ["layers.0.q_proj", "layers.0.o_proj", "layers.0.qkv", "layers.1.q_proj", "layers.1.o_proj",
                    "layers.1.qkv", "head"], seen
    assert isinstance(model.layers[0].q_proj, LinearLayer) and isinstance(model.layers[0].o_proj, LinearAllreduce)
    assert type(model.layers[1].o_proj) is nn.Linear and type(model.head) is nn.Linear  # SKIP; model_types not met
    assert isinstance(model.layers[1].qkv, SubParamLinearLayer)
    assert torch.allclose(model(ids), want)  # one rank: the same function
    strict = AutoTPConfig(layer_specs=[TPLayerSpec(patterns=["nothing"])], strict_mode=True)
    try:
        AutoTP(Model(), [], "", None, None, None, partition_config=strict)._replace_module(Model())
        raise AssertionError("strict_mode let an unmatched layer through")
    except ValueError as e:
        assert "No matching spec for layers.0.q_proj.weight" in str(e), e
    for bad in (dict(shape=(3, -1), partition_dim=2), dict(shape=((4, 0), -1)), dict(shape=(-1, (4, 4)))):
        try:
            TPLayerSpec(patterns=["x"], **bad)
            raise AssertionError(f"accepted {bad}")
        except ValueError:
            pass
    assert TPLayerSpec(patterns=["x"], shape=[[4, 2, 2], -1]).get_sub_param_sizes() == (4, 2, 2)
    assert TPLayerSpec(patterns=["x"], partition_type="row").get_partition_dim() == 1
    specs = TPPlanConverter.convert({"layers.*.q_proj": "colwise", "lm_head": "colwise_rep",
                                     "layers.*.o_proj.weight": "rowwise", "norm": "replicated_with_grad_allreduce"})
    assert [s.partition_type for s in specs] == [PartitionType.COLUMN, PartitionType.COLUMN, PartitionType.ROW,
                                                 PartitionType.SKIP]
    assert [s.gather_output for s in specs] == [False, True, False, False] and specs[3].grad_allreduce
    assert re.match(specs[0].patterns[0], "model.layers.3.q_proj.weight") and specs[2].patterns[0].endswith(r"\.weight$")
    assert TPPlanConverter.convert({}) is None
    try:
        TPPlanConverter.convert({"a": "colwise", "b": "local_colwise"})
        raise AssertionError("a partial plan was accepted")
    except ValueError as e:
        assert "local_colwise" in str(e)

@check("accelerators")
def _():
    import os
    from deepspeed.accelerator import get_accelerator, set_accelerator
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator
    from deepspeed.accelerator.cuda_accelerator import CUDA_Accelerator
    from deepspeed.accelerator.xpu_accelerator import XPU_Accelerator
    cpu = CPU_Accelerator()
    assert (cpu.device_name(), cpu.communication_backend_name()) == ("cpu", "gloo")
    assert (CUDA_Accelerator().device_name(1), CUDA_Accelerator().communication_backend_name()) == ("cuda:1", "nccl")
    assert XPU_Accelerator().device_name() == "xpu"
    set_accelerator(cpu)
    assert get_accelerator() is cpu
    t = torch.ones(3)
    pinned = cpu.pin_memory(t)
    assert cpu.is_pinned(pinned) == pinned.is_pinned() and cpu.unpin_memory(pinned) is None
    import deepspeed.utils.pin_memory as pm
    assert pm.get_active_native_pinned_memory() is None  # torch pinning unless native is asked for
    os.environ["DS_PIN_MEMORY_BACKEND"] = "native"
    try:
        pm.get_active_native_pinned_memory()
        raise AssertionError("native pinning without the op")
    except RuntimeError as e:
        assert "pin_memory op" in str(e), e
    finally:
        del os.environ["DS_PIN_MEMORY_BACKEND"]

print(json.dumps(results))
'''

_CHECKS = ("rollout_interface", "zenflow_config", "fp16_loss_scale", "fused_expert_layout", "autotuning",
           "autotp_partition_config", "accelerators")


@pytest.fixture(scope="module")
def compat_results():
    return run_compat_probe(_PROBE)


@pytest.mark.parametrize("check", _CHECKS)
def test_compat_deepspeed_internals(compat_results, check):
    assert compat_results.get(check) == "ok", compat_results.get(check, "not run")


# --------------------------------------------------------------------- rollout through the hybrid engine

def _hybrid_rollout_body(rank: int, world: int, compat: str, repo: str):
    sys.path[:0] = [compat, repo]  # this process only: the compat package as `deepspeed`
    import deepspeed
    from deepspeed.runtime.hybrid_engine import DeepSpeedHybridEngine
    from deepspeed.runtime.rollout import RolloutRequest, SamplingConfig, build_rollout
    from deepspeed.runtime.rollout.base import RolloutConfig

    from test_hybrid_engine import LoRALinear

    def lora_model():
        model = _tiny_opt()
        torch.manual_seed(3)
        for layer in model.model.decoder.layers:
            layer.self_attn.q_proj = LoRALinear(layer.self_attn.q_proj)
        return model

    prompts = torch.tensor([[1, 5, 6], [7, 8, 9]])
    attn = (prompts != 1).long()
    reference = lora_model()  # the same weights, generating unfused
    want = reference.generate(prompts.repeat_interleave(2, 0), attention_mask=attn.repeat_interleave(2, 0),
                              max_new_tokens=4, eos_token_id=None, do_sample=False, pad_token_id=1)
    engine, *_ = deepspeed.initialize(model=lora_model(), config={
        "train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "hybrid_engine": {"enabled": True}})
    assert isinstance(engine, DeepSpeedHybridEngine)
    tok = SimpleNamespace(pad_token_id=1, eos_token_id=None)
    rollout = build_rollout(RolloutConfig(), student_engine=engine, tokenizer=tok)
    engine.eval()
    batch = rollout.generate(RolloutRequest(prompts, attn), SamplingConfig(max_new_tokens=4, temperature=0,
                                                                            n_samples_per_prompt=2))
    fused = sum(m.fused_calls for m in engine.module.modules() if isinstance(m, LoRALinear))
    return {"ids": batch.input_ids.tolist(), "want": want.tolist(), "start": batch.response_start_idx.tolist(),
            "mask": batch.attention_mask.tolist(), "fused_calls": fused, "lora_fused_after": engine.is_lora_fused,
            "generate_latency": engine._generate_latency}


def test_hybrid_engine_rollout_generates_through_the_hybrid_engine():
    """HybridEngineRollout on a ZeRO-3 hybrid engine with DeepSpeed-Chat LoRA layers: the tokens of the
    model's own generate, made with the LoRA weights fused (the hybrid engine's generate ran), in DeepSpeed's
    rollout layout."""
    pytest.importorskip("transformers")
    out = run_distributed(_hybrid_rollout_body, 1, args=(str(COMPAT), str(REPO)))[0]
    assert out["ids"] == out["want"]
    assert out["start"] == [3] * 4
    prompt_masks = [[0, 1, 1]] * 2 + [[1, 1, 1]] * 2
    assert out["mask"] == [p + [int(t != 1) for t in row[3:]] for p, row in zip(prompt_masks, out["want"])]
    assert out["fused_calls"] > 0 and out["lora_fused_after"] is False and out["generate_latency"] > 0


# ------------------------------------------------------------------ zero.Init under a multi-process launcher

def _one_rank_init_body(rank: int, world: int):
    import shardwise

    os.environ["WORLD_SIZE"] = "4"  # what a launcher of 4 processes says, while this process's group has 1 rank
    try:
        try:
            with shardwise.zero.Init():
                torch.nn.Linear(2, 2)
            refused = None
        except RuntimeError as e:
            refused = str(e)
        with shardwise.zero.Init(data_parallel_group=torch.distributed.group.WORLD):  # asked for: fine
            torch.nn.Linear(2, 2)
    finally:
        os.environ["WORLD_SIZE"] = "1"
    return refused


def test_zero_init_refuses_a_one_rank_group_under_a_multi_process_launcher():
    """DeepSpeed's guard (``partition_parameters._contradicting_single_rank_pg_error``): a one-rank group where
    the launcher says WORLD_SIZE > 1 would leave every rank holding the whole model, so zero.Init raises."""
    from shardwise.zero.init import single_rank_group_error

    message = single_rank_group_error(1, None, {"WORLD_SIZE": "8"})
    assert "WORLD_SIZE=8" in message and "init_distributed" in message
    for args in ((1, None, {"WORLD_SIZE": "1"}), (1, None, {}), (8, None, {"WORLD_SIZE": "8"}),
                 (1, object(), {"WORLD_SIZE": "8"}), (1, None, {"WORLD_SIZE": "many"})):
        assert single_rank_group_error(*args) is None, args
    refused = run_distributed(_one_rank_init_body, 1)[0]
    assert refused is not None and "WORLD_SIZE=4" in refused
