"""Mixture of experts: DeepSpeed's MoE layer, its gates, and expert parallelism against one process."""

from __future__ import annotations

import contextlib

import pytest
import torch

from distributed import run_distributed, run_subtests

HIDDEN, TOKENS, EXPERTS = 8, 6, 4


class Net(torch.nn.Module):
    def __init__(self, *, ep_size=1, k=2, capacity_factor=4.0, drop_tokens=True, use_residual=False):
        super().__init__()
        from shardwise.moe.layer import MoE

        torch.manual_seed(0)
        self.inp = torch.nn.Linear(HIDDEN, HIDDEN)
        expert = torch.nn.Sequential(torch.nn.Linear(HIDDEN, 2 * HIDDEN), torch.nn.Tanh(),
                                     torch.nn.Linear(2 * HIDDEN, HIDDEN))
        self.moe = MoE(HIDDEN, expert, num_experts=EXPERTS, ep_size=ep_size, k=k, capacity_factor=capacity_factor,
                       min_capacity=0, drop_tokens=drop_tokens, use_rts=False, use_residual=use_residual,
                       top2_2nd_expert_sampling=False)
        self.out = torch.nn.Linear(HIDDEN, 1)

    def forward(self, x, y):
        h, l_aux, _ = self.moe(torch.tanh(self.inp(x)))
        return torch.nn.functional.mse_loss(self.out(h).squeeze(-1), y) + 0.01 * l_aux


def _set_experts(net, ep_rank, *, starve=False):
    """Global expert e gets weights drawn from seed 100 + e (so a token sent to the wrong expert shows);
    ``starve``: the gate never picks experts 2 and 3 (for inputs with positive features)."""
    moe = net.moe.deepspeed_moe
    with torch.no_grad():
        for j, expert in enumerate(moe.experts.deepspeed_experts):
            g = torch.Generator().manual_seed(100 + ep_rank * moe.num_local_experts + j)
            for p in expert.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
        if starve:
            moe.gate.wg.weight[2:] = -1.0


def _data(step, world):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.rand(world, 2, TOKENS // 2, HIDDEN, generator=g), torch.randn(world, 2, TOKENS // 2, generator=g)


def _reference(case, steps, world):
    """One process, every expert local; each rank's micro-batch forwarded on its own (the gate's l_aux and
    capacity are per rank), the loss their mean: the gradient data parallelism averages."""
    ep, stage, k, starve, *_ = case
    net = Net(k=k, drop_tokens=not starve)
    _set_experts(net, 0, starve=starve)
    opt = torch.optim.Adam(net.parameters(), lr=0.01)
    losses = []
    for step in range(steps):
        xs, ys = _data(step, world)
        per_rank = [net(xs[r], ys[r]) for r in range(world)]
        torch.stack(per_rank).mean().backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 0.05)
        opt.step()
        opt.zero_grad()
        losses.append([float(v.detach()) for v in per_rank])
    return losses, net


def _engine(case, rank):
    import shardwise
    from shardwise.moe.utils import split_params_into_different_moe_groups_for_optimizer

    ep, stage, k, starve, *options = case
    offload, under_init = (list(options) + [False, False])[:2]
    if under_init:  # built inside zero.Init: experts sharded within their expert-data-parallel group at once
        from shardwise import zero
        from shardwise.topology import expert_groups

        with zero.Init():
            net = Net(ep_size=ep, k=k, drop_tokens=not starve)
        group = expert_groups(ep).data_group  # no grid yet: cut from the world's data axis
        assert all(p.ds_process_group is group for p in net.moe.deepspeed_moe.experts.parameters())
        assert net.inp.weight.ds_process_group is None
        edit = zero.GatheredParameters(list(net.parameters()), modifier_rank=0)  # groups' first ranks
    else:
        net, edit = Net(ep_size=ep, k=k, drop_tokens=not starve), contextlib.nullcontext()
    with edit:
        _set_experts(net, rank % ep, starve=starve)
        if rank >= ep:  # the other replicas start elsewhere: the engine copies the first one's experts
            with torch.no_grad():
                for p in net.moe.deepspeed_moe.experts.parameters():
                    p.add_(1.0)
    groups_ = split_params_into_different_moe_groups_for_optimizer({"params": list(net.parameters()), "name": "all"})
    opt = torch.optim.Adam(groups_, lr=0.01)
    zero = {"stage": stage, "stage3_prefetch_bucket_size": 10**6}  # (ZeRO-3: units as large as the model allows)
    if offload:
        zero.update(offload_optimizer={"device": "cpu"}, offload_param={"device": "cpu"})
    engine, *_ = shardwise.initialize(model=net, optimizer=opt, config={
        "train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.05, "zero_optimization": zero})
    return engine


def _step(engine, step, rank, world):
    xs, ys = _data(step, world)
    loss = engine(xs[rank], ys[rank])
    engine.backward(loss)
    engine.step()
    return float(loss.detach())


def _train(case, rank, world, steps=2):
    ep, stage, k, starve, *_ = case
    ref_losses, ref = _reference(case, steps, world)
    engine = _engine(case, rank)
    losses = [_step(engine, step, rank, world) for step in range(steps)]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor([r[rank] for r in ref_losses]), rtol=1e-6, atol=0)
    mine = engine.strategy.module_state_dict(engine.module)  # every expert by global index (ZeRO-3: gathered)
    assert sorted(mine) == sorted(n for n, _ in ref.named_parameters())
    for name, p in ref.named_parameters():
        torch.testing.assert_close(mine[name], p.detach(), rtol=1e-6, atol=1e-7, msg=lambda m: f"{name}: {m}")
    experts = engine.grid.expert_groups(ep)  # the engine's grid holds the layers' groups
    assert engine.module.moe.expert_groups is experts and engine.module.moe.deepspeed_moe.ep_group is experts.group
    if ep > 1:
        assert engine.grid.group("expert") is experts.group and engine.grid.group("expert_data") is experts.data_group
    if ep > 1 and stage < 3:  # one strategy: the experts' buffers reduce over the expert-data group, the rest over data
        domains = {g.domain.name: g.domain.group for g in engine.strategy.groups}
        assert domains == {None: engine.dp_group, f"ep_size_{ep}": experts.data_group}, domains
    return {"ep": engine.grid.size("expert"), "edp": experts.data_size,
            "has_moe": engine.has_moe_layers, "dims_expert": engine.dims.expert,
            "offload": [getattr(engine.strategy, "offload_device", "none")]}


def _checkpoint(case, rank, world, folder, loads):
    """Save at ``case`` after two steps, take a third; every layout of ``loads`` loads the checkpoint and
    takes the same third step: the same weights (and so the same optimizer state went in)."""
    saver = _engine(case, rank)
    for step in range(2):
        _step(saver, step, rank, world)
    saver.save_checkpoint(folder, tag="t")
    _step(saver, 2, rank, world)
    after = saver.strategy.module_state_dict(saver.module)
    for load in loads:
        engine = _engine(load, rank)
        engine.load_checkpoint(folder, tag="t")
        _step(engine, 2, rank, world)
        got = engine.strategy.module_state_dict(engine.module)
        assert sorted(got) == sorted(after), load
        for name, value in after.items():
            torch.testing.assert_close(got[name], value, rtol=1e-6, atol=1e-7, msg=lambda m: f"{load} {name}: {m}")
    return {k: v.clone() for k, v in after.items()}


class LoopMoE(torch.nn.Module):
    """A Hugging Face-style block (Mixtral, Qwen-MoE before fused experts): softmax top-2 router, and a Python
    loop calling each expert on the tokens routed to it only (an expert no token chose is not called)."""

    def __init__(self):
        super().__init__()
        self.gate = torch.nn.Linear(HIDDEN, EXPERTS, bias=False)
        self.experts = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(HIDDEN, 2 * HIDDEN), torch.nn.Tanh(),
                                                               torch.nn.Linear(2 * HIDDEN, HIDDEN))
                                           for _ in range(EXPERTS))

    def forward(self, x):
        weights, chosen = torch.softmax(self.gate(x), -1).topk(2, -1)
        weights = weights / weights.sum(-1, keepdim=True)
        out = torch.zeros_like(x)
        for e, hit in enumerate(torch.nn.functional.one_hot(chosen, EXPERTS).permute(2, 1, 0)):
            slot, token = torch.where(hit)
            if token.numel():
                out = out.index_add(0, token, self.experts[e](x[token]) * weights[token, slot, None])
        return out


class LoopNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.moe, self.out = torch.nn.Linear(HIDDEN, HIDDEN), LoopMoE(), torch.nn.Linear(HIDDEN, 1)

    def forward(self, x, y):
        return torch.nn.functional.mse_loss(self.out(self.moe(torch.tanh(self.inp(x)))).squeeze(-1), y)


def _loop_data(step, world):
    g = torch.Generator().manual_seed(2000 + step)
    return torch.randn(world, 3, HIDDEN, generator=g), torch.randn(world, 3, generator=g)


def _loop_block(leaf, rank, world, steps=2):
    """Plain ZeRO-3 (every module its own unit, none persistent) on ``LoopNet``, whose ranks route their tokens
    to different experts. ``leaf``: "api" (set_z3_leaf_modules), "config" (zero_optimization.leaf_module) or
    None. Returns the losses and the whole model, or the error's text."""
    import shardwise
    from shardwise.utils import set_z3_leaf_modules

    net = LoopNet()
    if leaf == "api":
        set_z3_leaf_modules(net, [LoopMoE])
    zero = {"stage": 3, "stage3_prefetch_bucket_size": 1, "stage3_param_persistence_threshold": 0}
    if leaf == "config":
        zero["leaf_module"] = {"classes": ["LoopMoE"]}
    engine, *_ = shardwise.initialize(model=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.1), config={
        "train_micro_batch_size_per_gpu": 1, "gradient_clipping": 0, "zero_optimization": zero})
    losses = []
    try:
        for step in range(steps):
            xs, ys = _loop_data(step, world)
            losses.append(_step_loss(engine, xs[rank], ys[rank]))
    except RuntimeError as e:
        return str(e)
    return losses, engine.strategy.module_state_dict(engine.module)


def _step_loss(engine, x, y):
    loss = engine(x, y)
    engine.backward(loss)
    engine.step()
    return float(loss.detach())


SAVE = (2, 1, 2, False)  # ep 2, ZeRO-1
LOADS = [(1, 0, 2, False), (4, 2, 2, False), (2, 0, 2, False), (2, 3, 2, False)]


def _all_cases(rank, world, folder):
    cases = [(ep, stage, 2, False) for ep in (1, 2, 4) for stage in (0, 1, 2)]
    cases.append((2, 2, 1, True))  # top-1, dropless, experts 2 and 3 (ep rank 1) never chosen
    cases += [(2, 1, 2, False, True), (4, 2, 2, False, True)]  # the optimizer offloaded (stepping during backward)
    cases += [(1, 3, 2, False), (1, 3, 1, True)]  # ZeRO-3, every expert on every rank; then two never chosen
    # ZeRO-3, experts sharded within their expert-data-parallel group; ep 2 also with the optimizer and the
    # parameters offloaded, and with the experts of ep rank 1 never chosen
    cases += [(2, 3, 2, False), (4, 3, 2, False), (2, 3, 2, False, True), (2, 3, 1, True)]
    cases.append((2, 3, 2, False, False, True))  # ep 2, ZeRO-3, the model built inside zero.Init
    _checkpoint((2, 3, 2, False), rank, world, folder + "/z3", [(1, 0, 2, False), (4, 2, 2, False)])  # saved at ZeRO-3
    return (run_subtests(_train, cases, rank, world), _checkpoint(SAVE, rank, world, folder, LOADS),
            [_loop_block(leaf, rank, world) for leaf in ("api", "config", None)], _half_precision(rank))


def _half_precision(rank, steps=3):
    """ep 2 in fp16 (dynamic loss scale from 2^16: the first steps overflow and are skipped) and bf16 at
    ZeRO-2 and ZeRO-3: per dtype, the losses and skipped steps of both stages (they must agree: the
    overflow decision and the expert reduction are the same whichever stage shards the experts)."""
    import shardwise
    from shardwise.moe.utils import split_params_into_different_moe_groups_for_optimizer

    out = {}
    for dtype, half in (("fp16", torch.float16), ("bf16", torch.bfloat16)):
        for stage in (2, 3):
            net = Net(ep_size=2)
            _set_experts(net, rank % 2)
            opt = torch.optim.Adam(split_params_into_different_moe_groups_for_optimizer(
                {"params": list(net.parameters()), "name": "all"}), lr=0.01)
            engine, *_ = shardwise.initialize(model=net, optimizer=opt, config={
                "train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.05, dtype: {"enabled": True},
                "zero_optimization": {"stage": stage, "stage3_prefetch_bucket_size": 10**6}})
            losses = []
            for step in range(steps):
                xs, ys = _data(step, 4)
                loss = engine(xs[rank].to(half), ys[rank].to(half))
                engine.backward(loss)
                engine.step()
                losses.append(float(loss.detach()))
            out[(dtype, stage)] = (losses, engine.skipped_steps)
    return out


def test_expert_parallel_matches_one_process_and_checkpoints_reshard(tmp_path):
    import shardwise

    results = run_distributed(_all_cases, 4, args=(str(tmp_path),), timeout=400)
    for *_, half in results:  # fp16 / bf16, ep 2: ZeRO-3 trains as ZeRO-2 (fp16 skipping the same steps)
        assert half[("fp16", 2)] == half[("fp16", 3)] and half[("bf16", 2)] == half[("bf16", 3)], half
        assert half[("fp16", 2)][1] > 0 and all(v == v for v in half[("fp16", 2)][0]), half  # some steps skipped
    for out, _, _, _ in results:
        assert [(o["ep"], o["edp"]) for o in out[:9:3]] == [(1, 4), (2, 2), (4, 1)]
        assert all(o["has_moe"] for o in out) and [o["dims_expert"] for o in out[:9:3]] == [1, 2, 4]
        assert len(out) == 19
        assert [(o["ep"], o["edp"]) for o in out[14:16]] == [(2, 2), (4, 1)]
        assert [o["offload"] for o in out[10:12]] == [["cpu"], ["cpu"]]  # every part's optimizer offloaded
    _check_loop_blocks([r[2] for r in results])
    after = results[0][1]
    assert sum(".deepspeed_experts." in k for k in after) == EXPERTS * 4  # every expert, by global index
    # one process: the four ranks' micro-batches forwarded one by one, their mean loss (data parallelism's
    # gradient), from the ep 2 checkpoint
    from shardwise.moe.utils import split_params_into_different_moe_groups_for_optimizer

    net = Net(ep_size=1)
    opt = torch.optim.Adam(split_params_into_different_moe_groups_for_optimizer(
        {"params": list(net.parameters()), "name": "all"}), lr=0.01)
    engine, *_ = shardwise.initialize(model=net, optimizer=opt, config={"train_batch_size": 2,
                                                                        "gradient_clipping": 0.05})
    engine.load_checkpoint(str(tmp_path), tag="t")
    xs, ys = _data(2, 4)
    loss = torch.stack([engine(xs[r], ys[r]) for r in range(4)]).mean()
    engine.backward(loss)
    engine.step()
    got = engine.module.state_dict()
    for name, value in after.items():
        torch.testing.assert_close(got[name], value, rtol=1e-6, atol=1e-7, msg=lambda m: f"{name}: {m}")


def _check_loop_blocks(per_rank):
    """A leaf block trains as one process (each rank's micro-batch a term of the mean loss), although the
    ranks call different experts (checked here); without the leaf every rank stops at the first step with
    the error naming the block's experts."""
    world = len(per_rank)
    net = LoopNet()
    xs, _ = _loop_data(0, world)
    with torch.no_grad():
        chosen = [set(torch.softmax(net.moe.gate(torch.tanh(net.inp(xs[r]))), -1).topk(2, -1)[1].flatten().tolist())
                  for r in range(world)]
    assert any(c != chosen[0] for c in chosen) and any(len(c) < EXPERTS for c in chosen), chosen
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    want = []
    for step in range(2):
        xs, ys = _loop_data(step, world)
        losses = [net(xs[r], ys[r]) for r in range(world)]
        torch.stack(losses).mean().backward()
        opt.step()
        opt.zero_grad()
        want.append([float(v.detach()) for v in losses])
    for rank, (api, config, none) in enumerate(per_rank):
        for losses, state in (api, config):
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(want)[:, rank], rtol=1e-6, atol=0)
            for name, p in net.named_parameters():
                torch.testing.assert_close(state[name], p.detach(), rtol=1e-6, atol=1e-7)
        assert "disagree on which parameters to gather in the first step" in none and "moe.experts." in none, none


def test_layer_output_is_the_gate_weighted_expert_output():
    """Top-2 without dropping: each token's output is its two experts' outputs weighted by the
    renormalised softmax probabilities; top-1 with capacity 1 keeps one token per expert (the others: zero)."""
    from shardwise.moe.layer import MoE

    torch.manual_seed(0)
    moe = MoE(HIDDEN, torch.nn.Linear(HIDDEN, HIDDEN), num_experts=EXPERTS, k=2, capacity_factor=4.0,
              min_capacity=0, top2_2nd_expert_sampling=False)
    with torch.no_grad():
        for e in moe.deepspeed_moe.experts.deepspeed_experts:
            e.weight.normal_()
    x = torch.randn(3, 4, HIDDEN)
    out, l_aux, counts = moe(x)
    flat = x.reshape(-1, HIDDEN)
    probs = torch.softmax(flat @ moe.deepspeed_moe.gate.wg.weight.t(), dim=1)
    top, idx = probs.topk(2, dim=1)
    experts = moe.deepspeed_moe.experts.deepspeed_experts
    want = torch.stack([sum(top[t, i] / top[t].sum() * experts[int(idx[t, i])](flat[t]) for i in range(2))
                        for t in range(flat.shape[0])])
    torch.testing.assert_close(out.reshape(-1, HIDDEN), want, rtol=1e-5, atol=1e-6)
    assert int(counts.sum()) == 2 * flat.shape[0]
    me, ce = probs.mean(0), torch.nn.functional.one_hot(idx[:, 0], EXPERTS).float().mean(0)
    torch.testing.assert_close(l_aux, (me * ce).mean() * EXPERTS * EXPERTS)

    one = MoE(HIDDEN, torch.nn.Linear(HIDDEN, HIDDEN), num_experts=2, k=1, capacity_factor=0.01, min_capacity=1,
              use_rts=False)
    out, _, counts = one(torch.randn(6, HIDDEN))
    kept = (out.abs().sum(-1) > 0).sum()
    assert int(kept) == int((counts > 0).sum()) and int(counts.sum()) == 6  # counts are before dropping


def test_split_params_into_moe_groups():
    from shardwise.moe.utils import is_moe_param, split_params_into_different_moe_groups_for_optimizer

    net = Net(ep_size=1)
    groups = split_params_into_different_moe_groups_for_optimizer({"params": list(net.parameters()), "name": "p",
                                                                    "lr": 0.5})
    assert [g["name"] for g in groups] == ["p", "ep_size_1"] and groups[1]["moe"] and groups[1]["lr"] == 0.5
    assert not any(is_moe_param(p) for p in groups[0]["params"])
    assert {id(p) for p in groups[1]["params"]} == {id(p) for p in net.moe.deepspeed_moe.experts.parameters()}


def test_bad_sizes_are_named():
    import shardwise
    from shardwise.moe.layer import MoE
    from shardwise.parallel_dims import ParallelDims

    with pytest.raises(ValueError, match=r"num_experts \(3\) is not divisible by ep_size \(2\)"):
        MoE(HIDDEN, torch.nn.Linear(HIDDEN, HIDDEN), num_experts=3, ep_size=2)
    with pytest.raises(ValueError, match="MoE ep_size 3 with 4 data-parallel x 1 sequence-parallel ranks: not supp"):
        ParallelDims(data=4, expert=3).validate()
    ParallelDims(data=1, sequence=2, expert=2).validate()  # (every rank routes its own tokens: test_moe_compose)
    ParallelDims(data=2, tensor=2, expert=2, zero_stage=3).validate()
    with pytest.raises(ValueError, match=r"ep_size 2\) with tensor parallelism \(tensor 2\) and sequence"):
        ParallelDims(data=2, tensor=2, sequence=2, expert=2).validate()
    with pytest.raises(ValueError, match="MoE ep_size 2 with 1 data-parallel x 1 sequence-parallel ranks"):
        shardwise.initialize(model=Net(ep_size=2), config={"train_batch_size": 1,
                                                           "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    for stage in (1, 2, 3):  # (they train: the test above)
        ParallelDims(data=2, expert=2, zero_stage=stage, offload_optimizer=True).validate()


def test_expert_rank_lists_follow_deepspeeds_layout():
    """DeepSpeed's example: 16 ranks, tensor 2, ep 4: data groups [0,2,..,14] and [1,3,..,15] are cut in
    order into expert groups, and each expert's replicas are the same slot of each cut."""
    from shardwise.topology import expert_rank_lists as _get_expert_parallel_ranks

    ep, edp = _get_expert_parallel_ranks(16, 2, 4)
    assert ep == [[0, 2, 4, 6], [8, 10, 12, 14], [1, 3, 5, 7], [9, 11, 13, 15]]
    assert edp == [[0, 8], [2, 10], [4, 12], [6, 14], [1, 9], [3, 11], [5, 13], [7, 15]]
    ep, edp = _get_expert_parallel_ranks(8, 1, 2, pipe=2)  # two stages of 4 data ranks
    assert ep == [[0, 1], [2, 3], [4, 5], [6, 7]] and edp == [[0, 2], [1, 3], [4, 6], [5, 7]]
    with pytest.raises(ValueError, match="MoE ep_size=3 does not divide the data-parallel size 4"):
        _get_expert_parallel_ranks(8, 2, 3)
