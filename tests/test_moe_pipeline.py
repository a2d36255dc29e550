"""Expert parallelism inside a pipeline: MoE layers on one stage of pipe 2 x data 2 (ep 2 over that stage's
data ranks) train as one process does on the same layers (fp32, rtol 1e-6 per step)."""

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


def _engine(stage, rank, world, scheduler=None):
    import shardwise
    from shardwise.moe.utils import split_params_into_different_moe_groups_for_optimizer
    from shardwise.pipe import PipelineModule

    pipe, dp, ep = 2, world // 2, 2
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


def _train(stage, rank, world):
    engine = _engine(stage, rank, world)
    d = engine.grid.get_data_parallel_rank()
    losses = [_batch(engine, step) for step in range(STEPS)]
    state = engine.strategy.module_state_dict(engine.module)
    return {"losses": losses, "data_rank": d, "stage": engine.grid.get_pipe_parallel_rank(),
            "has_moe": engine.has_moe_layers, "state": {k: v.clone() for k, v in state.items()}}


def _cases(rank, world, folder):
    return run_subtests(_train, [0, 1, 2, 3], rank, world), _resume(1, rank, world, folder)


def test_expert_parallel_inside_a_pipeline_matches_one_process(tmp_path):
    results = run_distributed(_cases, 4, args=(str(tmp_path),), timeout=300)
    for _, (want, got) in results:
        assert want == got, (want, got)
    results = [r[0] for r in results]
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
                                           msg=lambda m: f"ZeRO {zero} {name}: {m}")
