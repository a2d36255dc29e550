"""AutoEP: Hugging Face MoE blocks replaced by expert-parallel ones (shardwise/moe/autoep)."""

from __future__ import annotations

import pytest
import torch

from autoep_models import KINDS, tiny_model

transformers = pytest.importorskip("transformers", minversion="5.0")  # (fused experts, router modules)


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
    # (the input gradient sums each token's expert contributions in another order than the model's loop:
    # one element in 240 can differ by a few float32 ulps of the largest gradients, about 4e-7 here)
    torch.testing.assert_close(x2.grad, x.grad, rtol=1e-6, atol=1e-6)
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


# -- expert parallelism against one process ----------------------------------------------------------
STEPS, WORLD = 3, 2
AUX = {"qwen3_moe": {"output_router_logits": True}}  # the model's auxiliary loss, through the router's logits


def _optimizer(model):
    return torch.optim.Adam(model.parameters(), lr=0.01)


def _ids(step):
    return torch.randint(0, 64, (WORLD, 2, 6), generator=torch.Generator().manual_seed(500 + step))


def _reference(kind, coeff=None, starve=False):
    """The unmodified model in one process: each rank's micro-batch forwarded on its own, the mean loss.
    ``coeff``: DeepSeek-V3's loss-free balancing done by hand (each router's bias moved after the step by
    the routes of both micro-batches)."""
    model = tiny_model(kind, starve=starve)
    opt = _optimizer(model)
    counts = {}
    routers = [m for m in model.modules() if hasattr(m, "e_score_correction_bias")] if coeff else []
    for r in routers:
        r.register_forward_hook(lambda m, a, out: counts.__setitem__(m, counts.get(m, 0) + torch.bincount(
            out[2].reshape(-1), minlength=m.num_experts)))
    losses = []
    for step in range(STEPS):
        ids = _ids(step)
        per_rank = [model(input_ids=ids[r], labels=ids[r], **AUX.get(kind, {})).loss for r in range(WORLD)]
        torch.stack(per_rank).mean().backward()
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for r in routers:
                c = counts.pop(r).float()
                assert not starve or c[r.num_experts // 2:].sum() == 0  # rank 1's experts: no route at all
                r.e_score_correction_bias += coeff * torch.sign(c.mean() - c)
        losses.append([float(v.detach()) for v in per_rank])
    return losses, model


def _train(case, rank, folder):
    import shardwise
    from shardwise.moe.autoep import AutoEPMoE

    kind, stage, ep, coeff, starve = case
    ref_losses, ref = _reference(kind, coeff, starve)
    model = tiny_model(kind, starve=starve)
    opt = _optimizer(model)  # built on the original experts: AutoEP re-points it
    engine, *_ = shardwise.initialize(model=model, optimizer=opt, config={
        "train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0,
        "zero_optimization": {"stage": stage, "stage3_gather_16bit_weights_on_model_save": True},
        "expert_parallel": {"enabled": True, "autoep_size": ep, "load_balance_coeff": coeff}})
    blocks = [m for m in engine.module.modules() if isinstance(m, AutoEPMoE)]
    assert blocks and all(b.num_local_experts == b.num_experts // ep for b in blocks)
    assert engine.has_moe_layers and engine.dims.expert == ep
    losses = []
    for step in range(STEPS):
        ids = _ids(step)
        loss = engine(input_ids=ids[rank], labels=ids[rank], **AUX.get(kind, {})).loss
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    torch.testing.assert_close(torch.tensor(losses), torch.tensor([r[rank] for r in ref_losses]), rtol=1e-6, atol=0)
    out = f"{folder}/{kind}-{stage}-{ep}"
    engine.save_16bit_model(out)  # every expert, in the model's published per-expert layout
    if rank == 0:
        engine.module.config.save_pretrained(out)
    engine.save_checkpoint(f"{out}-ckpt", tag="t")  # experts by global index
    want = {n: p.detach().clone() for n, p in [*ref.named_parameters(), *ref.named_buffers()]
            if not n.endswith("inv_freq")}
    return kind, out, want, losses


def _all_cases(rank, world, folder):
    from distributed import run_subtests

    # (kind, ZeRO stage, autoep_size, load_balance_coeff, starve: expert-parallel rank 1's experts never chosen).
    # At ZeRO-3 the experts are sharded within their expert-data-parallel group (of size 1 here) and gathered
    # around the block (external parameters). The last case's checkpoint is reloaded below.
    cases = [("deepseek_v3", 3, 2, None, False), ("qwen3_moe", 3, 2, None, False), ("qwen3_moe", 2, 2, None, False),
             ("deepseek_v3", 2, 2, 0.05, True)]
    return run_subtests(_train, cases, rank, folder)


def test_expert_parallel_trains_as_one_process_and_exports(tmp_path):
    """ep 2 over 2 ranks at ZeRO-2 and ZeRO-3, fp32: the losses of each step equal the unmodified model
    trained in one process; the exported folder loads with ``from_pretrained`` into the weights one process
    trained; the ep 2 checkpoint loads at ep 1 in one process and consolidates into a Hugging Face folder."""
    from distributed import run_distributed

    import shardwise

    results = run_distributed(_all_cases, WORLD, args=(str(tmp_path),), timeout=300)
    for kind, out, ref, _ in results[0]:
        _same_weights(transformers.AutoModelForCausalLM.from_pretrained(out), ref, kind)
    # the ep 2 checkpoint loads in one process at autoep_size 1 (experts by global index) and exports the same
    kind, out, ref, _ = results[0][-1]
    from shardwise.checkpoint.consolidate import consolidate_checkpoint

    consolidate_checkpoint(f"{out}-ckpt", tmp_path / "hf", tag="t", hf_config=out)  # `shardwise consolidate`
    _same_weights(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf"), ref, kind)
    model = tiny_model(kind, seed=1, starve=True)
    engine, *_ = shardwise.initialize(model=model, optimizer=_optimizer(model), config={
        "train_batch_size": 2, "expert_parallel": {"enabled": True, "autoep_size": 1}})
    engine.load_checkpoint(f"{out}-ckpt", tag="t")
    engine.save_16bit_model(tmp_path / "one")
    model.config.save_pretrained(tmp_path / "one")
    _same_weights(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "one"), ref, kind)


def _same_weights(loaded, ref, kind):
    got = {n: t for n, t in [*loaded.named_parameters(), *loaded.named_buffers()] if not n.endswith("inv_freq")}
    assert sorted(got) == sorted(ref), kind
    for name, want in ref.items():  # (weight gradients summed in another order: float rounding)
        torch.testing.assert_close(got[name], want, rtol=1e-5, atol=1e-6, msg=lambda m: f"{kind} {name}: {m}")


# -- options and bad input ---------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["qwen3_moe", "deepseek_v3"])
def test_loss_free_balancing_moves_the_bias_after_each_step(kind):
    """``load_balance_coeff``: after a step the bias of the over-loaded experts goes down by the coefficient and
    the others' up (DeepSeek-V3: its own ``e_score_correction_bias``); routing follows it. (Through the engine,
    over 2 ranks against the same balancing done by hand in one process: the spawned test below.)"""
    from shardwise.moe.autoep.block import AutoEPMoE
    from shardwise.moe.autoep.presets import spec_of

    block = tiny_model(kind).model.layers[1].mlp
    with torch.no_grad():
        block.gate.weight[0] = 3.0  # expert 0 wins every token of positive inputs
    mine = AutoEPMoE(block, spec_of(block, "qwen3_moe" if kind == "qwen3_moe" else kind, _cfg()), ep_size=1,
                     ep_rank=0, load_balance_coeff=0.5)
    bias = mine._selection_bias()
    assert bias is (mine.gate.e_score_correction_bias if kind == "deepseek_v3" else mine.expert_bias)
    start = bias.clone()
    opt = torch.optim.SGD(mine.parameters(), lr=0.0)
    x = torch.rand(4, 8, 16)

    def routes():
        from shardwise.moe.autoep.router import route

        return torch.bincount(route(mine.gate(x.reshape(-1, 16))[0], mine.spec, mine._selection_bias())[1].reshape(-1),
                              minlength=mine.num_experts)

    before = routes()
    mine(x).sum().backward()
    torch.testing.assert_close(bias, start)  # nothing moves before the step
    opt.step()
    mine.move_bias()  # (the engine calls it after each optimizer step)
    step = torch.sign(before.float().mean() - before.float()) * 0.5
    torch.testing.assert_close(bias, start + step)
    assert routes()[0] < before[0]


def test_bad_input_is_named():
    import shardwise
    from shardwise.config import load_config
    from shardwise.config.errors import ConfigError
    from shardwise.moe.autoep import check_sizes

    model = tiny_model("qwen3_moe")  # 4 experts per layer
    with pytest.raises(ValueError, match=r"autoep_size=3: the 4 experts of model.layers.0.mlp \(Qwen3MoeSparse"):
        check_sizes(model, _cfg(autoep_size=3), data_size=3)
    with pytest.raises(ValueError, match="autoep_size=2 does not divide the data-parallel size 3"):
        check_sizes(model, _cfg(autoep_size=2), data_size=3)
    with pytest.raises(ValueError, match="no MoE block AutoEP knows in Sequential.*classes are: Linear, ReLU"):
        shardwise.initialize(model=torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU()), config={
            "train_batch_size": 1, "expert_parallel": {"enabled": True, "autoep_size": 1}})
    with pytest.raises(ValueError, match="preset_model='llama': shardwise's AutoEP knows mixtral, qwen3_moe"):
        check_sizes(model, _cfg(preset_model="llama"), data_size=1)
    with pytest.raises(ValueError, match="preset_model='mixtral'"):
        check_sizes(model, _cfg(preset_model="mixtral"), data_size=1)
    with pytest.raises(ConfigError, match="not implemented yet: expert_parallel.comm_backend"):
        load_config({"expert_parallel": {"enabled": True, "comm_backend": "deepep"}}).check_supported()
    with pytest.raises(ConfigError, match="autoep_size"):
        load_config({"expert_parallel": {"enabled": True, "autoep_size": 0}})


def test_score_apply_pre_weights_the_token_before_the_expert():
    """``score_apply: "pre"``: each route computes expert(weight x token) and the routes are summed unweighted."""
    from dataclasses import replace

    from shardwise.moe.autoep.block import AutoEPMoE
    from shardwise.moe.autoep.presets import spec_of

    block = tiny_model("qwen3_moe").model.layers[1].mlp
    spec = replace(spec_of(block, "qwen3_moe", _cfg()), score_apply="pre")
    mine = AutoEPMoE(block, spec, ep_size=1, ep_rank=0)
    x = torch.randn(10, 16)
    with torch.no_grad():
        _, w, idx = block.gate(x)
        want = sum(block.experts(x * w[:, k:k + 1], idx[:, k:k + 1], torch.ones_like(w[:, k:k + 1])) for k in range(2))
        torch.testing.assert_close(mine(x.view(2, 5, 16)).view(10, 16), want, rtol=1e-6, atol=1e-7)
        assert not torch.allclose(want, block(x.view(2, 5, 16)).view(10, 16), atol=1e-4)  # a different model
