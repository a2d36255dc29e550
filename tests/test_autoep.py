"""AutoEP: Hugging Face MoE blocks replaced by expert-parallel ones (shardwise/moe/autoep)."""

from __future__ import annotations

import pytest
import torch

from autoep_models import KINDS, tiny_model

transformers = pytest.importorskip("transformers")


def _cfg(**keys):
    from shardwise.config.expert_parallel import ExpertParallelConfig

    return ExpertParallelConfig(enabled=True, **keys)


def _replace_one_process(model, cfg):
    from shardwise.moe.autoep.block import AutoEPMoE
    from shardwise.moe.autoep.presets import find_blocks, spec_of

    for path, module, preset in find_blocks(model, cfg):
        parent, _, child = path.rpartition(".")
        setattr(model.get_submodule(parent), child, AutoEPMoE(module, spec_of(module, preset, cfg), ep_size=1,
                                                              ep_rank=0))
    return model


@pytest.mark.parametrize("kind", KINDS)
def test_block_matches_the_hugging_face_block(kind):
    """Forward and gradients of the replaced block equal the model's own block (fp32, one process)."""
    import copy

    from shardwise.moe.autoep.block import AutoEPMoE

    model = tiny_model(kind)
    block = model.model.layers[1].mlp
    ours = copy.deepcopy(model)
    _replace_one_process(ours, _cfg())
    mine = ours.model.layers[1].mlp
    assert isinstance(mine, AutoEPMoE) and mine.num_local_experts == mine.num_experts
    x = torch.randn(3, 5, 16, requires_grad=True)
    x2 = x.detach().clone().requires_grad_(True)
    want, got = block(x), mine(x2)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    (want * torch.arange(16.0)).sum().backward()
    (got * torch.arange(16.0)).sum().backward()
    torch.testing.assert_close(x2.grad, x.grad, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(mine.gate.weight.grad, block.gate.weight.grad, rtol=1e-6, atol=1e-7)
    gate_up = torch.stack([torch.cat([e.weights()[0].grad, e.weights()[1].grad]) for e in mine.experts])
    # (a weight's gradient sums its rows in another order than the model's loop: float rounding only)
    torch.testing.assert_close(gate_up, block.experts.gate_up_proj.grad, rtol=1e-5, atol=1e-6)
    # the whole model, with the auxiliary loss where the model has one
    ids = torch.randint(0, 64, (2, 7))
    kw = {"output_router_logits": True} if kind in ("qwen3_moe", "qwen2_moe", "mixtral") else {}
    a, b = model(input_ids=ids, labels=ids, **kw), ours(input_ids=ids, labels=ids, **kw)
    torch.testing.assert_close(b.loss, a.loss, rtol=1e-6, atol=0)
    if kw:
        assert b.aux_loss is not None and torch.allclose(b.aux_loss, a.aux_loss, rtol=1e-6)
