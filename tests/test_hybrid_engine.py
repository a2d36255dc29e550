"""The hybrid engine (RLHF actor): generate() under ZeRO-3 gives the tokens of the whole model's own
generate, gathering each parameter once per call; LoRA fused for generation and put back; training
after generation matches a plain engine."""

from __future__ import annotations

import pytest
import torch

from distributed import run_distributed, run_subtests

pytest.importorskip("transformers")
pytest.importorskip("peft")

WORLD, PROMPTS, NEW_TOKENS, STEPS = 2, 4, 6, 2
Z3 = {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 2000}


class LoRALinear(torch.nn.Module):
    """DeepSpeed-Chat's LinearLayer_LoRA interface (fuse_lora_weight / unfuse_lora_weight / fuse_lora);
    counts the forwards that ran fused."""

    def __init__(self, linear: torch.nn.Linear, dim: int = 2) -> None:
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias
        self.weight.requires_grad = False
        rows, cols = linear.weight.shape
        self.lora_right_weight = torch.nn.Parameter(torch.randn(cols, dim) * 0.3)
        self.lora_left_weight = torch.nn.Parameter(torch.randn(dim, rows) * 0.3)
        self.fuse_lora, self.fused_calls = False, 0

    def delta(self):
        return (self.lora_left_weight.t() @ self.lora_right_weight.t()) * 0.5

    def fuse_lora_weight(self):
        if not self.fuse_lora:
            self.weight.data += self.delta()
        self.fuse_lora = True

    def unfuse_lora_weight(self):
        if self.fuse_lora:
            self.weight.data -= self.delta()
        self.fuse_lora = False

    def forward(self, x):
        if self.fuse_lora:
            self.fused_calls += 1
            return torch.nn.functional.linear(x, self.weight, self.bias)
        return torch.nn.functional.linear(x, self.weight, self.bias) + (x @ self.lora_right_weight
                                                                        @ self.lora_left_weight) * 0.5


def _model(lora: bool):
    from transformers import OPTConfig, OPTForCausalLM

    torch.manual_seed(0)
    cfg = OPTConfig(vocab_size=48, hidden_size=16, num_hidden_layers=2, ffn_dim=32, num_attention_heads=2,
                    max_position_embeddings=32, word_embed_proj_dim=16, dropout=0.0, attention_dropout=0.0,
                    pad_token_id=1, bos_token_id=2, eos_token_id=47)
    model = OPTForCausalLM(cfg)
    if lora == "peft":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    elif lora:
        for layer in model.model.decoder.layers:
            layer.self_attn.q_proj = LoRALinear(layer.self_attn.q_proj)
            layer.self_attn.v_proj = LoRALinear(layer.self_attn.v_proj)
    return model.eval()


def _config(zero, *, hybrid: bool, pin: bool = True):
    return {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "zero_optimization": zero,
            "hybrid_engine": {"enabled": hybrid, "max_out_tokens": 16, "pin_parameters": pin}}


def _prompts():
    g = torch.Generator().manual_seed(1)
    return torch.randint(3, 47, (PROMPTS, 5), generator=g)


def _generate(model_or_engine, prompts):
    return model_or_engine.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=NEW_TOKENS,
                                    min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=1,
                                    synced_gpus=torch.distributed.is_initialized())


def _count_all_gathers(fn):
    import shardwise.comm as comm

    real, calls = comm.all_gather_into_tensor, [0]

    def counted(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    comm.all_gather_into_tensor = counted
    try:
        return fn(), calls[0]
    finally:
        comm.all_gather_into_tensor = real


def _train(engine, *, generate_between: bool, rank: int):
    g = torch.Generator().manual_seed(2)
    losses = []
    for _ in range(STEPS):
        ids = torch.randint(3, 47, (2 * WORLD, 7), generator=g)[2 * rank:2 * rank + 2]
        if generate_between:
            engine.eval()
            engine.module.generate(ids[:, :3], attention_mask=torch.ones_like(ids[:, :3]), max_new_tokens=3,
                                   do_sample=False, pad_token_id=1, synced_gpus=True)
            engine.train()
        loss = engine(ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _case(case, rank, world):
    import shardwise
    from shardwise.runtime.hybrid_engine import HybridEngine

    name, zero, pin, lora, train = case
    prompts = _prompts()
    mine = prompts[rank * PROMPTS // world:(rank + 1) * PROMPTS // world]
    expected = _generate(_model(lora), mine)  # the whole model, this process alone

    model = _model(lora)
    engine, *_ = shardwise.initialize(model=model, config=_config(zero, hybrid=True, pin=pin))
    assert isinstance(engine, HybridEngine)
    engine.eval()
    before = {n: p.detach().clone() for n, p in model.named_parameters()} if zero["stage"] < 3 else {}
    peft_layers = [m for m in model.modules() if hasattr(m, "merge") and hasattr(m, "get_base_layer")]
    merged_calls = []
    for m in peft_layers:
        m.register_forward_pre_hook(lambda mod, args: merged_calls.append(mod.merged))
    tokens, gathers = _count_all_gathers(lambda: _generate(engine.module, mine))  # as DeepSpeed-Chat calls it
    assert torch.equal(tokens, expected), (name, tokens, expected)
    units = len(engine.strategy.units) if zero["stage"] == 3 else 0
    if zero["stage"] == 3 and pin:
        assert gathers == units, (name, gathers, units)  # once per generate() call
    elif zero["stage"] == 3:
        assert gathers > NEW_TOKENS * units // 2, (name, gathers, units)  # per module, per forward
    loras = [m for m in model.modules() if isinstance(m, LoRALinear)]
    if lora == "peft":
        assert peft_layers and merged_calls and all(merged_calls), name  # generated merged
        assert not any(m.merged for m in peft_layers), name
    elif lora:
        assert all(m.fused_calls > 0 and not m.fuse_lora for m in loras), name
        if zero["stage"] == 3:
            assert all(m.weight.numel() == 0 for m in loras), name  # released again
    for n, p in model.named_parameters():  # base weights back bit for bit
        if n in before:
            assert torch.equal(p.detach(), before[n]), (name, n)
    assert engine._generate_latency > 0 and engine._gather_latency >= 0

    if not train:
        return name, None
    engine.train()
    hybrid_losses = _train(engine, generate_between=True, rank=rank)
    plain, *_ = shardwise.initialize(model=_model(lora), config=_config(zero, hybrid=False))
    assert type(plain) is not HybridEngine
    plain.train()
    plain_losses = _train(plain, generate_between=False, rank=rank)
    assert hybrid_losses == plain_losses, (name, hybrid_losses, plain_losses)
    return name, hybrid_losses


CASES = [  # name, zero_optimization, pin_parameters, LoRA, train after generating
    ("zero3_pinned", Z3, True, False, False), ("zero3_per_module", Z3, False, False, False),
    ("zero3_lora", Z3, True, True, True), ("zero2_lora", {"stage": 2}, True, True, True),
    ("zero3_peft", Z3, True, "peft", False)]


class RewardModel(torch.nn.Module):
    """DeepSpeed-Chat's reward model in small: ``forward_value`` calls the backbone, not ``forward``."""

    def __init__(self) -> None:
        super().__init__()
        self.rwtransformer = _model(False).model
        self.v_head = torch.nn.Linear(16, 1, bias=False)

    def forward_value(self, ids):
        return self.v_head(self.rwtransformer(ids).last_hidden_state).squeeze(-1)


def _frozen_engines(rank, world):
    """DeepSpeed-Chat's reference and reward engines: no optimizer, bf16, ZeRO-0 or -3, called through
    a method of the model that skips its forward."""
    import shardwise

    ids = _prompts()
    torch.manual_seed(3)
    expected = RewardModel().to(torch.bfloat16).forward_value(ids)
    for stage in (0, 3):
        torch.manual_seed(3)
        engine, *_ = shardwise.initialize(model=RewardModel(), config={
            "train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True}, "zero_optimization": {"stage": stage}})
        with torch.no_grad():
            got = engine.forward_value(ids)
        assert torch.equal(got, expected), (stage, got, expected)


def _body(rank, world):
    _frozen_engines(rank, world)
    return run_subtests(_case, CASES, rank, world)


def test_hybrid_engine_generates_like_the_whole_model_and_trains_like_a_plain_engine():
    results = run_distributed(_body, WORLD, timeout=300)
    assert [name for name, _ in results[0]] == [c[0] for c in CASES]


def test_inference_tensor_parallel_is_refused_by_name():
    from shardwise.config import ConfigError, load_config

    cfg = load_config({"hybrid_engine": {"enabled": True, "inference_tp_size": 2}})
    with pytest.raises(ConfigError, match=r"hybrid_engine\.inference_tp_size \(= 2\)"):
        cfg.check_supported()
    load_config({"hybrid_engine": {"enabled": True, "max_out_tokens": 8}}).check_supported()
