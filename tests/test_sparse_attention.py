"""Block-sparse attention (shardwise.ops.sparse_attention): layouts checked against hand-worked
cases, and SparseSelfAttention equal to dense attention under the same mask, forward and backward."""

from __future__ import annotations

import math
import random

import pytest
import torch

from shardwise.ops.sparse_attention import (BigBirdSparsityConfig, BSLongformerSparsityConfig, DenseSparsityConfig,
                                            FixedSparsityConfig, LocalSlidingWindowSparsityConfig,
                                            SparseSelfAttention, SparsityConfig, VariableSparsityConfig)


def _rows(*rows):
    return torch.tensor([[int(c) for c in r] for r in rows], dtype=torch.int64)


# -- layouts (block = 1 token, so seq_len = number of blocks) --------------------------------
LAYOUTS = {
    "dense": (DenseSparsityConfig(num_heads=2, block=1), 3, _rows("111", "111", "111")),
    # windows [0,1] [2,3] [4]; global: the last block of each window (1, 3; 4 for the short one)
    "fixed_bi": (FixedSparsityConfig(num_heads=1, block=1, num_local_blocks=2), 5,
                 _rows("11011", "11011", "01111", "01111", "01011")),
    "fixed_uni": (FixedSparsityConfig(num_heads=1, block=1, num_local_blocks=2, attention="unidirectional"), 4,
                  _rows("1000", "1100", "0110", "0111")),
    "fixed_horizontal": (FixedSparsityConfig(num_heads=1, block=1, num_local_blocks=2,
                                             horizontal_global_attention=True), 4,
                         _rows("1101", "1111", "0111", "1111")),
    # windows [0] [1,2] [3,4] [5] (the last size repeats), global column 0
    "variable": (VariableSparsityConfig(num_heads=1, block=1, local_window_blocks=[1, 2]), 6,
                 _rows("100000", "111000", "111000", "100110", "100110", "100001")),
    "variable_ranges_uni": (VariableSparsityConfig(num_heads=1, block=1, local_window_blocks=[2],
                                                   global_block_indices=[1], global_block_end_indices=[3],
                                                   attention="unidirectional"), 5,
                            _rows("10000", "11100", "01100", "01110", "01101")),  # rows from 1 see 1-2
    # sliding window of 3 + block 0 global both ways, no random blocks
    "bigbird": (BigBirdSparsityConfig(num_heads=1, block=1, num_random_blocks=0), 5,
                _rows("11111", "11100", "11110", "10111", "10011")),
    "bigbird_uni": (BigBirdSparsityConfig(num_heads=1, block=1, num_random_blocks=0, attention="unidirectional"), 5,
                    _rows("10000", "11000", "11100", "10110", "10011")),
    "longformer": (BSLongformerSparsityConfig(num_heads=1, block=1, global_block_indices=[2]), 5,
                   _rows("11100", "11100", "11111", "00111", "00111")),
    "local_uni": (LocalSlidingWindowSparsityConfig(num_heads=1, block=1), 4, _rows("1000", "1100", "0110", "0011")),
    "local_bi": (LocalSlidingWindowSparsityConfig(num_heads=1, block=1, attention="bidirectional"), 4,
                 _rows("1100", "1110", "0111", "0011")),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layouts_match_hand_worked_cases(name):
    cfg, n, expected = LAYOUTS[name]
    layout = cfg.make_layout(n * cfg.block)
    assert layout.dtype == torch.int64 and layout.shape == (cfg.num_heads, n, n)
    for h in range(cfg.num_heads):
        assert torch.equal(layout[h], expected), f"{name} head {h}:\n{layout[h]}"


def test_layout_blocks_scale_and_heads_differ_when_asked():
    cfg = FixedSparsityConfig(num_heads=2, block=16, different_layout_per_head=True, num_local_blocks=2,
                              num_different_global_patterns=2)
    layout = cfg.make_layout(64)
    assert layout.shape == (2, 4, 4)
    assert torch.equal(layout[0], _rows("1101", "1101", "0111", "0111"))  # global: last block of each window
    assert torch.equal(layout[1], _rows("1110", "1110", "1011", "1011"))  # global: first block of each window


def test_random_blocks_follow_pythons_random_as_deepspeed():
    cfg = VariableSparsityConfig(num_heads=1, block=1, num_random_blocks=2, local_window_blocks=[1],
                                 global_block_indices=[])
    random.seed(7)
    layout = cfg.make_layout(6)
    random.seed(7)
    expected = torch.eye(6, dtype=torch.int64)
    for row in range(6):
        expected[row, random.sample(range(6), 2)] = 1
    assert torch.equal(layout[0], expected)
    big = BigBirdSparsityConfig(num_heads=1, block=1, num_random_blocks=1, num_sliding_window_blocks=1,
                                num_global_blocks=1, attention="unidirectional")
    random.seed(3)
    layout = big.make_layout(6)[0]
    assert torch.equal(layout, torch.tril(layout))  # unidirectional random blocks stay in the past


def test_bad_layout_arguments_are_refused():
    with pytest.raises(ValueError, match="dividable by Block size"):
        DenseSparsityConfig(num_heads=1, block=16).make_layout(40)
    with pytest.raises(ValueError, match="must be dividable by number of global blocks"):
        FixedSparsityConfig(num_heads=1, num_local_blocks=4, num_global_blocks=3)
    with pytest.raises(ValueError, match="different_layout_per_head"):
        FixedSparsityConfig(num_heads=2, num_different_global_patterns=2)
    with pytest.raises(NotImplementedError, match="unidirectional"):
        VariableSparsityConfig(num_heads=1, attention="causal")
    with pytest.raises(ValueError, match="same length"):
        BSLongformerSparsityConfig(num_heads=1, global_block_indices=[0, 2], global_block_end_indices=[1])
    with pytest.raises(NotImplementedError):
        SparsityConfig(num_heads=1).make_layout(32)


# -- SparseSelfAttention == dense attention under the same mask ------------------------------
B, H, L, D, BLOCK = 2, 2, 64, 8, 8

CONFIGS = {
    "dense": DenseSparsityConfig(num_heads=H, block=BLOCK),
    "fixed_uni": FixedSparsityConfig(num_heads=H, block=BLOCK, num_local_blocks=2, attention="unidirectional"),
    "fixed_per_head": FixedSparsityConfig(num_heads=H, block=BLOCK, different_layout_per_head=True,
                                          num_local_blocks=4, num_global_blocks=2, num_different_global_patterns=2,
                                          horizontal_global_attention=True),
    "variable": VariableSparsityConfig(num_heads=H, block=BLOCK, different_layout_per_head=True,
                                       num_random_blocks=1, local_window_blocks=[1, 3], global_block_indices=[2]),
    "bigbird": BigBirdSparsityConfig(num_heads=H, block=BLOCK, num_random_blocks=1),
    "longformer": BSLongformerSparsityConfig(num_heads=H, block=BLOCK, global_block_indices=[0, 5],
                                             global_block_end_indices=[1, 7], attention="unidirectional"),
    "local": LocalSlidingWindowSparsityConfig(num_heads=H, block=BLOCK, num_sliding_window_blocks=3),
}


def _dense_reference(q, k, v, layout, *, kpm=None, kpm_mode="add", am=None, am_mode="mul", rpe=None):
    """Plain softmax attention on the full score matrix, the layout expanded to tokens."""
    allowed = layout.bool().repeat_interleave(BLOCK, 1).repeat_interleave(BLOCK, 2)[None]  # [1, H, L, L]
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if rpe is not None:
        s = s + rpe
    if kpm is not None:
        if kpm_mode == "add":
            s = s + kpm[:, None, None, :]
        else:
            allowed = allowed & (kpm[:, None, None, :] != 0)
    if am is not None:
        if am_mode == "add":
            s = s + am
        else:
            allowed = allowed & (am != 0)
    s = s.masked_fill(~allowed, float("-inf"))
    return torch.softmax(s, dim=-1) @ v


def _inputs(seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, L, D, generator=g) for _ in range(4)]


def _compare(module, layout, seed, **masks):
    q, k, v, grad = _inputs(seed)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = module(*leaves, **masks)
    out.backward(grad)
    ref_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    kpm = masks.get("key_padding_mask")
    ref_masks = dict(kpm=None if kpm is None else kpm.reshape(B, L), kpm_mode=module.key_padding_mask_mode,
                     am=masks.get("attn_mask"), am_mode=module.attn_mask_mode, rpe=masks.get("rpe"))
    ref = _dense_reference(*ref_leaves, layout, **ref_masks)
    ref.backward(grad)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    for name, a, b in zip("qkv", leaves, ref_leaves):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"d{n}: {m}")


@pytest.mark.parametrize("name", list(CONFIGS))
def test_sparse_self_attention_equals_masked_dense(name):
    random.seed(0)
    module = SparseSelfAttention(CONFIGS[name], max_seq_length=2 * L)
    layout = module.master_layout[:, :L // BLOCK, :L // BLOCK]
    _compare(module, layout, seed=1)  # no masks
    # key padding (last 5 keys of sample 1) and an attention mask, in the default modes: add / mul
    kpm = torch.zeros(B, L)
    kpm[1, -5:] = -10000.0
    am = (torch.rand(L, L, generator=torch.Generator().manual_seed(2)) > 0.2).float()
    am.fill_diagonal_(1)
    _compare(module, layout, seed=3, key_padding_mask=kpm.view(B, 1, 1, L), attn_mask=am)


@pytest.mark.parametrize("kp_mode,am_mode", [("mul", "add"), ("add", "add"), ("mul", "mul")])
def test_mask_modes_and_rpe(kp_mode, am_mode):
    cfg = FixedSparsityConfig(num_heads=H, block=BLOCK, num_local_blocks=2)
    module = SparseSelfAttention(cfg, key_padding_mask_mode=kp_mode, attn_mask_mode=am_mode, max_seq_length=L)
    layout = module.master_layout
    g = torch.Generator().manual_seed(4)
    kpm = torch.ones(B, L) if kp_mode == "mul" else torch.zeros(B, L)
    kpm[0, -3:] = 0 if kp_mode == "mul" else -1e4
    am = torch.randn(L, L, generator=g) if am_mode == "add" else (torch.rand(L, L, generator=g) > 0.3).float()
    if am_mode == "mul":
        am.fill_diagonal_(1)
    rpe = 0.1 * torch.randn(1, H, L, L, generator=g)
    _compare(module, layout, seed=5, key_padding_mask=kpm, attn_mask=am, rpe=rpe)


def test_transposed_key_shorter_sequence_and_errors():
    cfg = BSLongformerSparsityConfig(num_heads=H, block=BLOCK)
    module = SparseSelfAttention(cfg, max_seq_length=4 * L)
    q, k, v, _ = _inputs(6)
    with torch.no_grad():
        out = module(q, k.transpose(-1, -2), v)  # DeepSpeed accepts a key already transposed
    torch.testing.assert_close(out, _dense_reference(q, k, v, cfg.make_layout(L)), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="dividable by Block size"):
        module(q[:, :, :60], k[:, :, :60], v[:, :, :60])
    with pytest.raises(ValueError, match="exceeds max_seq_length"):
        SparseSelfAttention(cfg, max_seq_length=L)(*(torch.randn(1, H, 2 * L, D) for _ in range(3)))
    with pytest.raises(ValueError, match="key_padding_mask_mode"):
        SparseSelfAttention(cfg, key_padding_mask_mode="sub")


def test_deepspeed_module_path():
    import importlib

    mod = importlib.import_module("shardwise.ops.sparse_attention")
    assert mod.SparseSelfAttention is SparseSelfAttention and mod.FixedSparsityConfig is FixedSparsityConfig
    with pytest.raises(ModuleNotFoundError, match="not supported by shardwise"):
        importlib.import_module("shardwise.ops.sparse_attention.bert_sparse_self_attention")


def test_config_block_builds_the_layout():
    from shardwise.config import load_config
    from shardwise.ops.sparse_attention import sparsity_config_from_dict

    block = {"mode": "fixed", "block": 16, "num_local_blocks": 2, "attention": "unidirectional"}
    cfg = load_config({"train_batch_size": 1, "sparse_attention": block})
    cfg.check_supported()  # the block is accepted; the model builds its attention from it
    sc = sparsity_config_from_dict(cfg.sparse_attention, num_heads=2)
    assert isinstance(sc, FixedSparsityConfig)
    assert torch.equal(sc.make_layout(64)[1], _rows("1000", "1100", "0110", "0111"))
    with pytest.raises(ValueError, match="sparse_attention.mode = 'sparse'"):
        sparsity_config_from_dict({"mode": "sparse"}, 2)
    with pytest.raises(ValueError, match="sparse_attention.num_local_blocks is not a setting of mode 'bigbird'"):
        sparsity_config_from_dict({"mode": "bigbird", "num_local_blocks": 4}, 2)
