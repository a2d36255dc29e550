"""ZeRO-3 with the module hooks off for generation (TRL's ``unwrap_model_for_generation``, DeepSpeed's
``deepspeed.runtime.zero.unwrap_model_for_generation``): ``engine.optimizer.parameter_offload``."""

from __future__ import annotations

import torch

from distributed import run_distributed
from models import base_config, make_data, make_model, mse, zero_fill_grads

STEPS, BATCH = 4, 8
Z3 = {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 200}


def _trl_remove_hooks(engine):  # what TRL 1.16's trl.models.utils.remove_hooks does
    offload = engine.optimizer.parameter_offload
    for p in [p for _, p in engine.module.named_parameters()] + [p for _, p in offload.module.ds_external_parameters()]:
        p.ds_active_sub_modules.clear()
    for hook in offload.forward_hooks + offload.backward_hooks:
        hook.remove()
    offload.forward_hooks, offload.backward_hooks = [], []


def _trl_add_hooks(engine):  # trl.models.utils.add_hooks
    offload = engine.optimizer.parameter_offload
    if not offload.param_coordinator.is_invalid_trace():
        offload.param_coordinator._invalidate_trace()
    offload._register_deepspeed_module(offload.module)


def _body(rank, world):
    import shardwise
    from shardwise.zero.param_offload import gathered_for_generation

    model = make_model()
    engine, *_ = shardwise.initialize(model=model, config=base_config(train_micro_batch_size_per_gpu=BATCH // world,
                                                                        zero_optimization=Z3))
    hooks = len(engine.optimizer.parameter_offload.forward_hooks)
    x, y = make_data(STEPS, BATCH)
    per = BATCH // world
    losses, outputs, hooks_inside = [], [], []
    for s in range(STEPS):
        xs, ys = x[s, rank * per:(rank + 1) * per], y[s, rank * per:(rank + 1) * per]
        loss = mse(engine(xs), ys)
        engine.backward(loss)
        engine.step()
        t = torch.tensor(loss.item())
        torch.distributed.all_reduce(t)
        losses.append(t.item() / world)
        if s == 0:  # TRL's way, inside GatheredParameters over every parameter
            with shardwise.zero.GatheredParameters(list(engine.parameters())), torch.no_grad():
                _trl_remove_hooks(engine)
                hooks_inside.append(len(engine.optimizer.parameter_offload.forward_hooks))
                outputs.append(engine.module(x[s + 1]))
                _trl_add_hooks(engine)
        if s == 1:  # DeepSpeed's deepspeed.runtime.zero.unwrap_model_for_generation
            with gathered_for_generation(engine) as unwrapped, torch.no_grad():
                hooks_inside.append(len(engine.optimizer.parameter_offload.forward_hooks))
                outputs.append(unwrapped.module(x[s + 1]))
    after = len(engine.optimizer.parameter_offload.forward_hooks)
    return losses, outputs, hooks, hooks_inside, after


def test_generation_with_hooks_off_keeps_stage3_training_exact():
    results = run_distributed(_body, 2, timeout=180)
    model = make_model()  # one process, the whole batch (as reference_training_for), outputs after steps 1, 2
    x, y = make_data(STEPS, BATCH)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.01)
    ref_losses, ref_outputs = [], []
    for s in range(STEPS):
        loss = mse(model(x[s]), y[s])
        opt.zero_grad()
        loss.backward()
        zero_fill_grads(model)
        opt.step()
        ref_losses.append(loss.item())
        if s < 2:
            with torch.no_grad():
                ref_outputs.append(model(x[s + 1]))
    for losses, outputs, hooks, hooks_inside, after in results:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-6, atol=1e-7)
        for out, ref in zip(outputs, ref_outputs):
            torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-7)
        assert hooks > 0 and hooks_inside == [0, 0] and after == hooks

