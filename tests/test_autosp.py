"""AutoSP (shardwise.sequence.autosp): under 2 gloo ranks, a tiny ViT whose attention ``auto_wrap_model_for_sp``
wrapped gives one process's outputs, input gradients and (summed over the ranks) weight gradients, with and
without a CLS token, for even and uneven patch slices, and trains under the engine (sequence parallel 2,
ZeRO 1 and 3) with one process's losses and weights; the three fusion adapters give the fused sequence
built by hand here and one process's gradients for the projection, the visual tokens and the text (LLaVA's
through DeepSpeed's names in compat/deepspeed). Bad input is refused by name."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from distributed import run_distributed, run_subtests

COMPAT = str(Path(__file__).resolve().parents[1] / "compat" / "deepspeed")
IMG, CTX, START, END = -200, 92546, 151652, 151653
TOL = {"rtol": 1e-6, "atol": 1e-6}


class ViTAttention(torch.nn.Module):
    """Non-causal multi-head attention named like Hugging Face's (AutoSP finds it by class name);
    returns ``(output, None)`` as HF's does."""

    def __init__(self, dim: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.heads, self.qkv, self.out = heads, torch.nn.Linear(dim, 3 * dim, bias=False), torch.nn.Linear(dim, dim)

    def forward(self, hidden_states, head_mask=None):
        b, n, d = hidden_states.shape
        q, k, v = self.qkv(hidden_states).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        o = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, d)
        return self.out(o), None


class SiglipAttention(ViTAttention):  # no CLS token in AutoSP's table; returns a tensor
    def forward(self, hidden_states, head_mask=None):
        return super().forward(hidden_states)[0]


class LlamaAttention(torch.nn.Module):  # a language-model attention: reported, never wrapped
    pass


class _Block(torch.nn.Module):
    def __init__(self, attn: torch.nn.Module, dim: int = 16) -> None:
        super().__init__()
        self.norm, self.attn = torch.nn.LayerNorm(dim), attn
        self.mlp = torch.nn.Sequential(torch.nn.Linear(dim, 32), torch.nn.GELU(), torch.nn.Linear(32, dim))

    def forward(self, x):
        a = self.attn(self.norm(x))
        x = x + (a[0] if isinstance(a, tuple) else a)
        return x + self.mlp(x)


class _TinyViT(torch.nn.Module):
    def __init__(self, attn_cls) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList([_Block(attn_cls()), _Block(attn_cls())])
        self.mm_projector = torch.nn.Linear(16, 16)
        self.language_model = torch.nn.ModuleList([LlamaAttention()])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def _sum_over_ranks(t: torch.Tensor) -> torch.Tensor:
    t = t.clone()
    torch.distributed.all_reduce(t)
    return t


def _vit_case(case, rank: int):
    """One process on all patches vs 2 ranks on their slices (rank 0 gets the extra patch when uneven)."""
    from shardwise.sequence.autosp import UlyssesSPViTAttention, auto_wrap_model_for_sp

    attn_cls, patches = case
    skip = 1 if attn_cls is ViTAttention else 0
    torch.manual_seed(0)
    model = _TinyViT(attn_cls)
    ref = copy.deepcopy(model)
    x = torch.randn(2, skip + patches, 16)
    w = torch.randn(2, skip + patches, 16)
    x_ref = x.clone().requires_grad_()
    (ref(x_ref) * w).sum().backward()
    out_ref = ref(x)

    group = torch.distributed.new_group([0, 1])
    auto_wrap_model_for_sp(model, group)
    auto_wrap_model_for_sp(model, group)  # a second call wraps nothing twice
    for block in model.blocks:
        assert isinstance(block.attn, UlyssesSPViTAttention) and type(block.attn.attn) is attn_cls
        assert block.attn.has_cls_token == bool(skip)
    assert type(model.language_model[0]) is LlamaAttention
    n = patches // 2 + (rank < patches % 2)
    start = skip + rank * (patches // 2) + min(rank, patches % 2)
    mine = list(range(skip)) + list(range(start, start + n))
    local = x[:, mine].clone().requires_grad_()
    out = model(local)
    loss = (out[:, skip:] * w[:, start:start + n]).sum()
    if rank == 0:  # the CLS output is on every rank: its loss counted once
        loss = loss + (out[:, :skip] * w[:, :skip]).sum()
    loss.backward()

    torch.testing.assert_close(out, out_ref[:, mine], **TOL)
    torch.testing.assert_close(local.grad[:, skip:], x_ref.grad[:, start:start + n], **TOL)
    torch.testing.assert_close(_sum_over_ranks(local.grad[:, :skip]), x_ref.grad[:, :skip], **TOL)
    worst = 0.0
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        if q.grad is None:  # the unused projection
            assert p.grad is None, name
            continue
        g = _sum_over_ranks(p.grad)
        torch.testing.assert_close(g, q.grad, **TOL, msg=lambda m: f"{name}: {m}")
        worst = max(worst, ((g - q.grad).abs().max() / q.grad.abs().max()).item())
    return worst


def _slice_loss(out, w, rank: int, start: int, n: int):
    """This rank's share of ``(output * w).sum()``: its patches, and the CLS token on rank 0 only."""
    loss = (out[:, 1:] * w[:, start:start + n]).sum()
    return loss + (out[:, :1] * w[:, :1]).sum() if rank == 0 else loss


def _engine_case(stage: int, rank: int):
    """Three SGD steps (so a wrong gradient scale shows) of the engine at sequence parallel 2, the slices'
    losses added over the group, give one process's losses and weights."""
    import shardwise
    from shardwise.sequence.autosp import auto_wrap_model_for_sp
    from shardwise.sequence.layer import sequence_sum

    torch.manual_seed(0)
    model = _TinyViT(ViTAttention)
    ref = copy.deepcopy(model)
    data = [(torch.randn(2, 7, 16), torch.randn(2, 7, 16)) for _ in range(3)]  # CLS + 6 patches
    opt = torch.optim.SGD(ref.parameters(), lr=1e-2)
    ref_losses = []
    for x, w in data:
        loss = (ref(x) * w).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        ref_losses.append(loss.item())

    sys.path.insert(0, COMPAT)  # DeepSpeed's mpu module (compat/deepspeed): a view of the grid shardwise lays out
    from deepspeed.runtime.sequence_parallel import parallel_state_sp

    parallel_state_sp.initialize_sequence_parallel(2)
    group = parallel_state_sp.get_sequence_parallel_group()
    auto_wrap_model_for_sp(model, group)
    config = {"train_micro_batch_size_per_gpu": 2, "sequence_parallel_size": 2, "gradient_clipping": 0,
              "optimizer": {"type": "SGD", "params": {"lr": 1e-2}}, "zero_optimization": {"stage": stage}}
    engine, *_ = shardwise.initialize(model=model, config=config, mpu=parallel_state_sp)
    start = 1 + 3 * rank
    for step, (x, w) in enumerate(data):
        out = engine(torch.cat([x[:, :1], x[:, start:start + 3]], dim=1))
        loss = sequence_sum(_slice_loss(out, w, rank, start, 3), group)
        engine.backward(loss)
        engine.step()
        assert abs(loss.item() - ref_losses[step]) <= 1e-6 * abs(ref_losses[step]), (step, loss.item(), ref_losses)
    from shardwise.utils import safe_get_full_fp32_param

    for (name, p), q in zip(engine.module.named_parameters(), ref.parameters()):
        torch.testing.assert_close(safe_get_full_fp32_param(p), q.detach(), rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"ZeRO {stage}, {name}: {m}")


# Fusion layouts: input_ids of 2 samples, and the fused rows expected (t<i>: text row i, v<j>: visual
# token j, z: zero padding), written out by hand from the model's rule.
_LAYOUTS = {
    "llava": ([[5, IMG, 7, 8, IMG, 9], [5, 6, IMG, 7, 8, 9]],
              ["t0 v0 v1 t2 t3 v2 v3 t5 z z", "t0 t1 v0 v1 v2 v3 t3 t4 t5 z"]),
    "internvl": ([[1, 2, CTX, CTX, CTX, CTX, 3, 4], [1, CTX, CTX, 2, 3, 4, 5, 6]],
                 ["t0 t1 v0 v1 v2 v3 t6 t7", "t0 v0 v1 t3 t4 t5 t6 t7"]),
    "qwen2vl": ([[0, START, 9, 9, END, 0, START, 9, 9, END], [START, 9, 9, 9, 9, END, 0, 0, 0, 0]],
                ["t0 t1 v0 v1 t4 t5 t6 v2 v3 t9", "t0 v0 v1 v2 v3 t5 t6 t7 t8 t9"]),
}


def _by_hand(rows: list[str], text, visual):
    pick = {"t": lambda b, i: text[b, i], "v": lambda b, i: visual[b, i], "z": lambda b, i: text.new_zeros(6)}
    return torch.stack([torch.stack([pick[s[0]](b, int(s[1:] or 0)) for s in r.split()]) for b, r in enumerate(rows)])


def _adapter(kind: str, projection, group):
    from shardwise.sequence.autosp import fusion

    if kind == "qwen2vl":
        return fusion.Qwen2VLFusionAdapter(projection, group, vision_start_token_id=START, vision_end_token_id=END)
    if kind == "internvl":
        return fusion.InternVLFusionAdapter(projection, group, image_token_id=CTX)
    sys.path.insert(0, COMPAT)  # LLaVA through DeepSpeed's names (compat/deepspeed)
    from deepspeed.sequence.autosp_fusion import LlavaFusionAdapter

    adapter = LlavaFusionAdapter(projection, group, image_token_id=IMG)
    assert isinstance(adapter, fusion.LlavaFusionAdapter)
    return adapter


def _fusion_case(kind: str, rank: int):
    """Visual tokens sharded 3 / 1 over the ranks; one process splices them all (by hand) into the text."""
    ids, rows = _LAYOUTS[kind]
    ids = torch.tensor(ids)
    torch.manual_seed(1)
    proj = torch.nn.Linear(8, 6)
    proj_ref = copy.deepcopy(proj)
    visual, text = torch.randn(2, 4, 8), torch.randn(2, ids.shape[1], 6)
    visual_ref, text_ref = visual.clone().requires_grad_(), text.clone().requires_grad_()
    fused_ref = _by_hand(rows, text_ref, proj_ref(visual_ref))
    w = torch.randn_like(fused_ref)
    (fused_ref * w).sum().backward()

    adapter = _adapter(kind, proj, torch.distributed.new_group([0, 1]))
    mine = slice(0, 3) if rank == 0 else slice(3, 4)
    local_visual, local_text = visual[:, mine].clone().requires_grad_(), text.clone().requires_grad_()
    out = adapter(local_visual, local_text, ids)
    half = fused_ref.shape[1] // 2
    rows_mine = slice(rank * half, (rank + 1) * half)
    (out * w[:, rows_mine]).sum().backward()

    torch.testing.assert_close(out, fused_ref[:, rows_mine].detach(), **TOL)
    torch.testing.assert_close(local_visual.grad, visual_ref.grad[:, mine], **TOL)
    torch.testing.assert_close(_sum_over_ranks(local_text.grad), text_ref.grad, **TOL)
    for p, q in zip(proj.parameters(), proj_ref.parameters()):
        torch.testing.assert_close(_sum_over_ranks(p.grad), q.grad, **TOL)


def _deepspeed_style_subclass(rank: int):
    """A DeepSpeed-style adapter that overrides _splice_visual_into_text is the one the forward calls."""
    sys.path.insert(0, COMPAT)
    from deepspeed.sequence.autosp_fusion import ModalityFusionSPAdapter

    class TextOnly(ModalityFusionSPAdapter):
        def _splice_visual_into_text(self, text_embeds, visual_embeds, input_ids):
            return text_embeds * 2

    text = torch.randn(1, 6, 4)
    out = TextOnly(torch.nn.Identity(), torch.distributed.new_group([0, 1]))(torch.randn(1, 1, 4), text,
                                                                            torch.zeros(1, 6, dtype=torch.long))
    torch.testing.assert_close(out, text[:, 3 * rank:3 * rank + 3] * 2, rtol=0, atol=0)


def _two_ranks(rank: int, world: int):
    worst = run_subtests(_vit_case, [(ViTAttention, 8), (SiglipAttention, 5), (ViTAttention, 3)], rank)
    run_subtests(_fusion_case, ["llava", "internvl", "qwen2vl"], rank)
    _deepspeed_style_subclass(rank)
    run_subtests(_engine_case, [1, 3], rank)
    return max(worst)


def test_autosp_matches_one_process():
    worst = run_distributed(_two_ranks, 2, timeout=90)
    print(f"AutoSP ViT: summed weight gradients vs one process, worst max|diff|/max|grad| {max(worst):.1e}")


def test_bad_input_is_refused_by_name():
    from shardwise.sequence.autosp import (InternVLFusionAdapter, LlavaFusionAdapter, Qwen2VLFusionAdapter,
                                           UlyssesSPViTAttention, auto_wrap_model_for_sp)

    text, ids = torch.randn(1, 4, 3), torch.tensor([[1, IMG, 2, IMG]])
    with pytest.raises(ValueError, match="2 image placeholders .* 3 visual tokens"):
        LlavaFusionAdapter(torch.nn.Identity(), None)(torch.randn(1, 3, 3), text, ids)
    with pytest.raises(ValueError, match="input_ids"):
        LlavaFusionAdapter(torch.nn.Identity(), None)(torch.randn(1, 3, 3), text, ids[:, :3])
    with pytest.raises(ValueError, match="3 visual placeholder tokens but only 2"):
        InternVLFusionAdapter(torch.nn.Identity(), None, image_token_id=CTX)(
            torch.randn(1, 2, 3), text, torch.tensor([[CTX, CTX, CTX, 0]]))
    qwen = Qwen2VLFusionAdapter(torch.nn.Identity(), None, vision_start_token_id=START, vision_end_token_id=END)
    for bad in ([START, 0, 0, 0], [END, 0, START, 0], [START, 0, START, END]):
        with pytest.raises(ValueError, match="do not form ordered start/end pairs"):
            qwen(torch.randn(1, 2, 3), text, torch.tensor([bad]))
    with pytest.raises(ValueError, match="no attention module of Sequential"):
        auto_wrap_model_for_sp(torch.nn.Sequential(torch.nn.Linear(2, 2)), None)
    vit_only = torch.nn.Sequential(ViTAttention())  # wrapping twice is not "nothing found", nor a second wrapper
    auto_wrap_model_for_sp(auto_wrap_model_for_sp(vit_only, None), None)
    assert type(vit_only[0]) is UlyssesSPViTAttention and type(vit_only[0].attn) is ViTAttention
    with pytest.raises(ValueError, match="CLS token first"):
        UlyssesSPViTAttention(torch.nn.Identity(), None)(torch.randn(2, 0, 4))
