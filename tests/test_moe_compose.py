"""Expert parallelism composed with pipeline, tensor and sequence parallelism, against one process (fp32,
rtol 1e-6 per step): MoE layers on one stage of pipe 2 x data 2 (ep 2 over that stage's data ranks); a
tensor-parallel MLP before an MoE layer at tensor 2 x data 2 (each tensor rank runs half of every expert's
slots); AutoEP on a Hugging Face Qwen3-MoE under Ulysses sequence parallelism (ep 2 over the two sequence
ranks)."""

from __future__ import annotations

import torch

from distributed import run_distributed, run_subtests

HIDDEN, ROWS, MICRO, EXPERTS, STEPS = 8, 3, 2, 4, 3


class MoEBlock(torch.nn.Module):
    """DeepSpeed's MoE layer as a pipeline layer: the output goes on, the auxiliary loss is dropped (a
    pipeline passes one tensor between layers). Global expert ``e`` starts from seed ``100 + e``."""

    def __init__(self, ep_size: int = 1, ep_rank: int = 0):
        super().__init__()
        from shardwise.moe.layer import MoE

        expert = torch.nn.Sequential(torch.nn.Linear(HIDDEN, 2 * HIDDEN), torch.nn.Tanh(),
                                     torch.nn.Linear(2 * HIDDEN, HIDDEN))
        self.moe = MoE(HIDDEN, expert, num_experts=EXPERTS, ep_size=ep_size, k=2, capacity_factor=4.0,
                       min_capacity=0, use_rts=False, top2_2nd_expert_sampling=False)
        with torch.no_grad():
            torch.manual_seed(7)
            self.moe.deepspeed_moe.gate.wg.weight.copy_(torch.randn(EXPERTS, HIDDEN))
            local = self.moe.deepspeed_moe.num_local_experts
            for j, e in enumerate(self.moe.deepspeed_moe.experts.deepspeed_experts):
                g = torch.Generator().manual_seed(100 + ep_rank * local + j)
                for p in e.parameters():
                    p.copy_(torch.randn(p.shape, generator=g) * 0.5)

    def forward(self, x):
        return self.moe(x)[0]


def _layers(ep_size=1, ep_rank=0):
    torch.manual_seed(0)
    first, last = torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.Linear(HIDDEN, 1)
    return [first, torch.nn.Tanh(), MoEBlock(ep_size, ep_rank), last]


def _loss(out, y):
    return torch.nn.functional.mse_loss(out.squeeze(-1), y)


def _data(step, dp):
    g = torch.Generator().manual_seed(500 + step)
    return torch.rand(dp, MICRO, ROWS, HIDDEN, generator=g), torch.randn(dp, MICRO, ROWS, generator=g)


def _reference(dp):
    """One process: every rank's micro-batches forwarded one by one (the gate's capacity is per forward),
    the loss their mean."""
    net = torch.nn.Sequential(*_layers())
    opt = torch.optim.Adam(net.parameters(), lr=0.01)
    losses = []
    for step in range(STEPS):
        xs, ys = _data(step, dp)
        per = torch.stack([torch.stack([_loss(net(xs[d, m]), ys[d, m]) for m in range(MICRO)]) for d in range(dp)])
        per.mean().backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 0.05)
        opt.step()
        opt.zero_grad()
        losses.append(per.mean(1).tolist())  # each data rank's train_batch loss
    return losses, net


def _engine(stage, rank, world, scheduler=None, ep=2):
    import shardwise
    from shardwise.moe.utils import split_params_into_different_moe_groups_for_optimizer
    from shardwise.pipe import PipelineModule

    pipe, dp = 2, world // 2
    model = PipelineModule(_layers(ep, (rank % dp) % ep), num_stages=pipe, loss_fn=_loss, partition_method="uniform")
    opt = torch.optim.Adam(split_params_into_different_moe_groups_for_optimizer(
        {"params": [p for p in model.parameters()], "name": "all"}), lr=0.01)
    engine, *_ = shardwise.initialize(model=model, optimizer=opt, config={
        "train_micro_batch_size_per_gpu": ROWS, "gradient_accumulation_steps": MICRO, "gradient_clipping": 0.05,
        "zero_optimization": {"stage": stage}, **({"scheduler": scheduler} if scheduler else {})})
    return engine


def _batch(engine, step):
    dp, d = engine.grid.get_data_parallel_world_size(), engine.grid.get_data_parallel_rank()
    xs, ys = _data(step, dp)
    return float(engine.train_batch(iter([(xs[d, m], ys[d, m]) for m in range(MICRO)])))


def _resume(stage, rank, world, folder):
    """Saved after two steps, the next two steps of the saver and of a fresh engine that loaded it agree
    bitwise (the second one shows the learning rates: the stages hold different param groups)."""
    warmup = {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.02, "warmup_num_steps": 6}}
    saver = _engine(stage, rank, world, warmup)
    for step in range(2):
        _batch(saver, step)
    saver.save_checkpoint(folder, tag="t")
    want = [_batch(saver, step) for step in (2, 3)]
    loaded = _engine(stage, rank, world, warmup)
    loaded.load_checkpoint(folder, tag="t")
    return want, [_batch(loaded, step) for step in (2, 3)]


def _train(case, rank, world):
    stage, ep = case  # (ep 1: only the second stage has MoE layers, and no expert axis)
    engine = _engine(stage, rank, world, ep=ep)
    d = engine.grid.get_data_parallel_rank()
    losses = [_batch(engine, step) for step in range(STEPS)]
    state = engine.strategy.module_state_dict(engine.module)
    return {"losses": losses, "data_rank": d, "stage": engine.grid.get_pipe_parallel_rank(),
            "has_moe": engine.has_moe_layers, "state": {k: v.clone() for k, v in state.items()}}


def _four_ranks(rank, world, folder):
    """One spawn for the 4-rank cases: the pipeline (ZeRO 0, 1, 3 and a resume at ZeRO-1), then tensor."""
    return (run_subtests(_train, [(0, 2), (1, 2), (3, 2), (1, 1)], rank, world), _resume(1, rank, world, folder),
            run_subtests(_tensor_train, [(2, 0), (2, 2), (1, 2), (1, 3), (2, 3)], rank, world))


def test_expert_parallel_inside_a_pipeline_and_with_tensor_parallelism_matches_one_process(tmp_path):
    results = run_distributed(_four_ranks, 4, args=(str(tmp_path),), timeout=400)
    for _, (want, got), _ in results:
        assert want == got, (want, got)
    _check_pipeline([r[0] for r in results])
    _check_tensor([r[2] for r in results])


def _check_pipeline(results):
    want, ref = _reference(2)
    names = dict(ref.named_parameters())
    want = torch.tensor(want).mean(1)  # train_batch's loss: the mean over the data ranks, as DeepSpeed's
    for per_rank in results:
        for zero, out in enumerate(per_rank):
            torch.testing.assert_close(torch.tensor(out["losses"]), want, rtol=1e-6, atol=0)
            assert out["has_moe"] == (out["stage"] == 1), out["stage"]
            held = {k for k in names if k.startswith(("2.", "3.")) == (out["stage"] == 1)}
            assert sorted(out["state"]) == sorted(held), (zero, out["stage"])  # every expert, by global index
            for name in held:
                torch.testing.assert_close(out["state"][name], names[name].detach(), rtol=1e-6, atol=1e-7,
                                           msg=lambda m: f"case {zero} {name}: {m}")


# -- AutoEP under Ulysses sequence parallelism -----------------------------------------------------------
VOCAB = 64


def _sample(seed, length):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (1, length), generator=g)
    labels = ids.clone()
    labels[0, :2] = -100
    return {"input_ids": ids, "position_ids": torch.arange(length)[None], "labels": labels}


SAMPLES = [_sample(10 + k, n) for k, n in enumerate((12, 8, 10, 6))]  # rank j's loader: SAMPLES[j::2]


def _qwen3_moe():
    from autoep_models import tiny_model

    model = tiny_model("qwen3_moe").train()
    model.set_attn_implementation("sdpa")  # (what Ulysses wraps: the same in the reference)
    return model


def _sp_reference():
    model = _qwen3_moe()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    losses = []
    for s in SAMPLES:
        loss = model(**s).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach() for n, p in model.named_parameters()}


def _sp_autoep(stage, rank, world):
    import shardwise
    from shardwise.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter
    from shardwise.utils import safe_get_full_fp32_param

    model = _qwen3_moe()
    mpu = UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=model, core_attn_implementation="sdpa", sequence_parallel_size=world,
        micro_batch_size=1, seq_length_is_variable=True)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    engine, *_ = shardwise.initialize(model=model, optimizer=opt, mpu=mpu, config={
        "train_micro_batch_size_per_gpu": 1, "sequence_parallel_size": world, "gradient_clipping": 0.5,
        "zero_optimization": {"stage": stage}, "expert_parallel": {"enabled": True, "autoep_size": 2}})
    assert engine.dims.expert == 2 and engine.dims.sequence == world and engine.dims.data == 1
    batches = UlyssesSPDataLoaderAdapter(SAMPLES[rank::world], sp_rank=mpu.get_sequence_parallel_rank(),
                                         sp_group=mpu.get_sequence_parallel_group(), sp_world_size=world,
                                         device=engine.device)
    losses = []
    for batch in batches:
        batch = dict(batch)
        shift_labels = batch.pop("shift_labels")
        logits = engine(**batch).logits
        loss = engine.module.loss_function(logits=logits, labels=None, shift_labels=shift_labels, vocab_size=VOCAB)
        good = (shift_labels != -100).view(-1).sum()  # the whole sequence's loss: shards weighted by their tokens
        per_rank = torch.distributed.nn.functional.all_gather(loss, group=mpu.get_sequence_parallel_group())
        counts = torch.distributed.nn.functional.all_gather(good, group=mpu.get_sequence_parallel_group())
        loss = sum(per_rank[r] * counts[r] for r in range(world)) / sum(counts)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    state = engine.strategy.module_state_dict(engine.module)  # every expert (the other rank's gathered)
    return losses, {k: v.clone() for k, v in state.items()}


def _sp_cases(rank, world):
    return run_subtests(_sp_autoep, [3], rank, world)  # ZeRO-3 (experts sharded: edp 1 here)


def test_autoep_under_sequence_parallelism_matches_one_process():
    want, params = _sp_reference()
    runs = run_distributed(_sp_cases, 2, timeout=240)
    for losses, state in [run for per_rank in runs for run in per_rank]:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(want), rtol=1e-6, atol=0)
        assert len(state) > len(params)  # (per-expert names: compared in the model's fused layout below)
        for name, want_p in params.items():
            prefix, _, leaf = name.rpartition(".")
            experts = range(want_p.shape[0]) if prefix.endswith("mlp.experts") else ()
            if leaf == "gate_up_proj":
                got = torch.stack([torch.cat([state[f"{prefix}.{e}.gate_proj.weight"],
                                              state[f"{prefix}.{e}.up_proj.weight"]]) for e in experts])
            elif leaf == "down_proj" and experts:
                got = torch.stack([state[f"{prefix}.{e}.down_proj.weight"] for e in experts])
            else:
                got = state[name]
            # (parameters after the steps: one element can differ by a few float32 ulps, 2-5e-7 seen, from the
            # order the sequence-parallel attention and the dispatch sum in; the losses are checked at rtol 1e-6)
            torch.testing.assert_close(got, want_p, rtol=1e-6, atol=1e-6, msg=lambda m: f"{name}: {m}")


# -- tensor parallelism: the tokens are the same on both tensor ranks, each runs half of the slots ------------
class TensorMoENet(torch.nn.Module):
    def __init__(self, ep_size=1, ep_rank=0, tensor=False):
        super().__init__()
        from shardwise.tensor_parallel import ColumnParallelLinear, RowParallelLinear

        torch.manual_seed(0)
        if tensor:
            self.up = ColumnParallelLinear(HIDDEN, 2 * HIDDEN, gather_output=False)
            self.down = RowParallelLinear(2 * HIDDEN, HIDDEN, input_is_parallel=True)
        else:
            self.up, self.down = torch.nn.Linear(HIDDEN, 2 * HIDDEN), torch.nn.Linear(2 * HIDDEN, HIDDEN)
        self.moe = MoEBlock(ep_size, ep_rank)
        self.out = torch.nn.Linear(HIDDEN, 1)

    def forward(self, x, y):
        return _loss(self.out(self.moe(self.down(torch.tanh(self.up(x))))), y)


def _tensor_reference(dp):
    net = TensorMoENet()
    opt = torch.optim.SGD(net.parameters(), lr=0.5)  # (not Adam: it would blow the tensor-parallel sums' rounding
    # in near-zero gradient elements up to the learning rate; clipping shows the norm, each expert counted once)
    losses = []
    for step in range(STEPS):
        xs, ys = _data(step, dp)
        per = torch.stack([net(xs[d, 0], ys[d, 0]) for d in range(dp)])
        per.mean().backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 0.05)
        opt.step()
        opt.zero_grad()
        losses.append(per.tolist())
    return losses, {n: p.detach() for n, p in net.named_parameters()}


def _tensor_train(case, rank, world):
    import shardwise
    from shardwise.moe.utils import split_params_into_different_moe_groups_for_optimizer
    from shardwise.topology import ParallelGrid, PipeModelDataParallelTopology

    ep, stage = case
    grid = ParallelGrid(PipeModelDataParallelTopology(num_pp=1, num_mp=2, num_dp=world // 2))
    d, t = grid.get_data_parallel_rank(), grid.get_tensor_model_parallel_rank()
    with grid.active():
        net = TensorMoENet(ep, d % ep, tensor=True)
    opt = torch.optim.SGD(split_params_into_different_moe_groups_for_optimizer(
        {"params": list(net.parameters()), "name": "all"}), lr=0.5)
    engine, *_ = shardwise.initialize(model=net, optimizer=opt, mpu=grid, config={
        "train_micro_batch_size_per_gpu": ROWS, "gradient_clipping": 0.05, "zero_optimization": {"stage": stage}})
    losses = []
    for step in range(STEPS):
        xs, ys = _data(step, world // 2)
        loss = engine(xs[d, 0], ys[d, 0])
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    state = engine.strategy.module_state_dict(engine.module)  # (experts gathered by global index)
    return {"losses": losses, "d": d, "t": t, "state": {k: v.clone() for k, v in state.items()}}


def _check_tensor(results):
    want, params = _tensor_reference(2)
    for per_rank in results:
        for out in per_rank:
            torch.testing.assert_close(torch.tensor(out["losses"]), torch.tensor(want)[:, out["d"]], rtol=1e-6, atol=0)
            for name, want_p in params.items():
                got = out["state"][name]
                if name.startswith(("up.", "down.weight")):  # this tensor rank's slice
                    want_p = want_p.chunk(2, 1 if name == "down.weight" else 0)[out["t"]]
                torch.testing.assert_close(got, want_p, rtol=1e-6, atol=1e-7, msg=lambda m: f"{name}: {m}")
