"""3D parallelism: the reference GPT (shardwise.models.gpt) trained on data x pipe x tensor grids gives
the same losses and gathered parameters as one process (fp32), with clipping by the global norm; a
checkpoint saved on one grid loads on another and training continues identically."""
from __future__ import annotations

import torch

from distributed import run_distributed, run_subtests
from shardwise.models.gpt import GPT, GPTConfig

CFG = GPTConfig(vocab_size=32, seq_len=8, hidden=16, n_layers=2, n_heads=2)
STEPS, MICRO, ROWS = 3, 2, 8  # optimizer steps, micro-batches per step, sequences per step
CLIP, LR = 0.5, 1e-2


def data(step: int):
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, CFG.vocab_size, (ROWS, CFG.seq_len + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def reference(steps: int):
    model = GPT(CFG)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    losses = []
    for step in range(steps):
        x, y = data(step)
        opt.zero_grad()
        loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        losses.append(float(loss))
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _config(dp: int, zero: int) -> dict:
    return {"train_batch_size": ROWS, "gradient_accumulation_steps": MICRO,
            "train_micro_batch_size_per_gpu": ROWS // MICRO // dp, "gradient_clipping": CLIP,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
            "zero_optimization": {"stage": zero, "reduce_bucket_size": 200}}


def _engine(case: dict):
    import shardwise
    from shardwise.models.gpt import gpt_pipeline_module
    from shardwise.topology import ParallelGrid, PipeModelDataParallelTopology

    dp, pp, tp = case["dp"], case["pp"], case["tp"]
    topo = PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=dp)
    cfg = {**_config(dp, case.get("zero", 0)), **case.get("config", {})}
    if pp > 1:
        model = gpt_pipeline_module(CFG, topology=topo, partition_method="uniform")
        engine, *_ = shardwise.initialize(model=model, config=cfg)
    else:
        grid = ParallelGrid(topo)
        engine, *_ = shardwise.initialize(model=GPT(CFG), mpu=grid, config=cfg)
    return engine


def _run(engine, first: int, count: int) -> list[float]:
    grid = engine.grid
    dp, d = grid.get_data_parallel_world_size(), grid.get_data_parallel_rank()
    per = ROWS // dp // MICRO
    losses = []
    for step in range(first, first + count):
        x, y = data(step)
        mine = [(x[(d * MICRO + m) * per:(d * MICRO + m + 1) * per], y[(d * MICRO + m) * per:(d * MICRO + m + 1) * per])
                for m in range(MICRO)]
        if grid.get_pipe_parallel_world_size() > 1:
            losses.append(float(engine.train_batch(iter(mine))))
            continue
        total = torch.zeros(())
        for xm, ym in mine:
            loss = engine(xm, ym)
            engine.backward(loss)
            engine.step()
            total += loss.detach() / MICRO / dp
        if dp > 1:
            torch.distributed.all_reduce(total, group=grid.get_data_parallel_group())
        losses.append(float(total))
    return losses


def _full_params(engine) -> dict:
    """Every parameter whole (tensor shards all-gathered), from tensor rank 0 of data rank 0."""
    grid = engine.grid
    out = {}
    for name, p in engine.module.named_parameters():
        t = p.detach()
        if getattr(p, "tensor_model_parallel", False) and grid.get_tensor_model_parallel_world_size() > 1:
            parts = [torch.empty_like(t) for _ in range(grid.get_tensor_model_parallel_world_size())]
            torch.distributed.all_gather(parts, t.contiguous(), group=grid.get_tensor_model_parallel_group())
            t = torch.cat(parts, dim=p.partition_dim)
        out[name] = t.clone()
    keep = grid.get_data_parallel_rank() == 0 and grid.get_tensor_model_parallel_rank() == 0
    return out if keep else {}


def _train(case: dict, ckpt: str):
    engine = _engine(case)
    if case.get("load"):  # saved by another grid after 2 steps: continue with step 3
        engine.load_checkpoint(ckpt, tag="t")
        assert engine.global_steps == 2
        losses = _run(engine, 2, STEPS - 2)
    else:
        losses = _run(engine, 0, 2)
        if case.get("save"):
            engine.save_checkpoint(ckpt, tag="t")
        losses += _run(engine, 2, STEPS - 2)
    if case.get("save16"):
        engine.save_16bit_model(ckpt + "/16bit")
    from shardwise import checkpointing

    return {"losses": losses, "params": _full_params(engine), "kept": checkpointing.get_profile()["kept_bytes"]}


def _body(rank, world, cases, ckpt):
    return run_subtests(lambda c: (c["name"], _train(c, ckpt)), cases)


def _check(results, cases):
    ref_losses, ref_params = reference(STEPS)
    for case in cases:
        merged = {}
        want = ref_losses[2:] if case.get("load") else ref_losses
        for per_rank in results:
            got = dict(per_rank)[case["name"]]
            torch.testing.assert_close(got["losses"], want, rtol=1e-6, atol=0, msg=case["name"])
            merged.update(got["params"])
            if case.get("config", {}).get("activation_checkpointing"):  # saved inputs were cut over tp
                assert got["kept"] > 0, case["name"]
        assert merged.keys() == ref_params.keys(), case["name"]
        for k in ref_params:  # Adam turns rounding-level gradient differences of near-zero gradients into
            # updates of up to ~1e-6 over 3 steps; a wrong clip or a missed reduction moves them by ~lr
            torch.testing.assert_close(merged[k], ref_params[k], rtol=1e-5, atol=1e-5,
                                       msg=lambda m, k=k: f"{case['name']} {k}: {m}")
    return ref_params


# Saved at (dp 2, pp 2, tp 2) under ZeRO-1; loaded at (dp 1, pp 2, tp 2), (dp 2, pp 1, tp 2) ZeRO-2 and
# (dp 4, tp 1) ZeRO-0: each continues exactly as one process does.
CASES_8 = [{"name": "dp2 pp2 tp2", "dp": 2, "pp": 2, "tp": 2, "zero": 1, "save": True}]
CASES_4 = [{"name": "dp2 pp1 tp2", "dp": 2, "pp": 1, "tp": 2, "zero": 2, "save16": True},
           {"name": "resume dp1 pp2 tp2", "dp": 1, "pp": 2, "tp": 2, "zero": 0, "load": True},
           {"name": "resume dp2 pp1 tp2", "dp": 2, "pp": 1, "tp": 2, "zero": 2, "load": True},
           {"name": "resume dp4 tp1", "dp": 4, "pp": 1, "tp": 1, "zero": 0, "load": True},
           # last: the activation_checkpointing settings are process-wide and outlive the engine
           {"name": "dp1 pp2 tp2 partitioned activations", "dp": 1, "pp": 2, "tp": 2, "zero": 1,
            "config": {"pipeline": {"activation_checkpoint_interval": 1},
                       "activation_checkpointing": {"partition_activations": True}}}]


def test_3d_parity_and_checkpoint_across_grids(tmp_path):
    from safetensors.torch import load_file

    from shardwise.checkpoint.consolidate import get_fp32_state_dict_from_checkpoint

    ckpt = str(tmp_path)
    _check(run_distributed(_body, 8, args=(CASES_8, ckpt), timeout=300), CASES_8)
    # the checkpoint's weights are the whole tensors of one process after 2 steps
    _, ref2 = reference(2)
    consolidated = get_fp32_state_dict_from_checkpoint(ckpt, tag="t")
    assert consolidated.keys() == ref2.keys()
    for k in ref2:
        torch.testing.assert_close(consolidated[k], ref2[k], rtol=1e-5, atol=1e-5)
    ref_final = _check(run_distributed(_body, 4, args=(CASES_4, ckpt), timeout=300), CASES_4)
    whole = load_file(str(tmp_path / "16bit" / "model.safetensors"))  # save_16bit_model: unsharded
    assert whole.keys() == ref_final.keys()
    for k in ref_final:
        torch.testing.assert_close(whole[k], ref_final[k], rtol=1e-5, atol=1e-5)
