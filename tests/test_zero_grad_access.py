"""Writing a parameter's whole gradient (``safe_set_full_grad``), ZeRO-3's per-rank accessors
(``safe_*_local_*``), ``empty_partition_cache``, ``ignore_unused_parameters: false``,
``zero_force_ds_cpu_optimizer`` and ``skip_init`` under ``zero.Init``: one spawn of two ranks, every case inside it."""

from __future__ import annotations

import torch

from distributed import run_distributed
from models import make_data, mse


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(7, 13), torch.nn.Tanh(), torch.nn.Linear(13, 3))


def _new_grads(model):
    g = torch.Generator().manual_seed(1)
    return {n: torch.randn(p.shape, generator=g) for n, p in model.named_parameters()}


def _cfg(stage, **zero):
    return {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0.0,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 30, **zero}}


def _set_grad_case(stage, rank):
    """Backward, then every gradient replaced by a known tensor: read back, and the step uses it."""
    import shardwise
    from shardwise.utils import safe_get_full_grad, safe_set_full_grad, safe_update_full_grad_vectorized

    model = _model()
    name_of = {id(p): n for n, p in model.named_parameters()}
    engine, *_ = shardwise.initialize(model=model, config=_cfg(stage))
    x, y = make_data(2, 8)
    engine.backward(mse(engine(x[0, rank * 4:(rank + 1) * 4]), y[0, rank * 4:(rank + 1) * 4]))
    new = _new_grads(_model())
    half = dict(list(model.named_parameters())[:2])
    for n, p in half.items():
        safe_set_full_grad(p, new[n])
    rest = [p for n, p in model.named_parameters() if n not in half]
    safe_update_full_grad_vectorized(rest, lambda old, p: new[name_of[id(p)]])
    read = {n: safe_get_full_grad(p) for n, p in model.named_parameters()}
    engine.step()
    with shardwise.zero.GatheredParameters(list(model.parameters())):
        after = {n: p.detach().clone() for n, p in model.named_parameters()}
    return read, after


def _local_case(rank, world):
    """ZeRO-3: each rank reads and writes its own chunk; the whole tensors agree."""
    import shardwise
    from shardwise.utils import (safe_get_full_grad, safe_get_full_optimizer_state, safe_get_local_fp32_param,
                                 safe_get_local_grad, safe_get_local_optimizer_state, safe_set_local_grad,
                                 safe_set_local_optimizer_state)

    model = _model()
    engine, *_ = shardwise.initialize(model=model, config=_cfg(3))
    x, y = make_data(2, 8)
    engine.backward(mse(engine(x[0, rank * 4:(rank + 1) * 4]), y[0, rank * 4:(rank + 1) * 4]))
    new = _new_grads(_model())
    out = {"chunks_ok": True}
    for n, p in model.named_parameters():
        c = -(-p.ds_numel // world)
        whole = torch.zeros(c * world)
        whole[: p.ds_numel] = safe_get_full_grad(p).reshape(-1)
        out["chunks_ok"] &= torch.equal(safe_get_local_grad(p), whole[rank * c:(rank + 1) * c])
        mine = torch.zeros(c * world)
        mine[: p.ds_numel] = new[n].reshape(-1)
        safe_set_local_grad(p, mine[rank * c:(rank + 1) * c])
    out["grads"] = {n: safe_get_full_grad(p) for n, p in model.named_parameters()}
    engine.step()
    p = model[0].weight
    c = -(-p.ds_numel // world)
    out["fp32_chunk"] = safe_get_local_fp32_param(p)
    doubled = safe_get_local_optimizer_state(p, "exp_avg") * 2
    safe_set_local_optimizer_state(p, doubled, "exp_avg")
    out["exp_avg"] = safe_get_full_optimizer_state(p, "exp_avg")
    out["exp_avg_chunk"] = doubled
    out["c"] = c
    return out


def _cache_case(rank):
    """Persistent units stay gathered after a forward; empty_partition_cache releases them, and the
    next forward gathers them again with the same values."""
    import shardwise

    engine, *_ = shardwise.initialize(model=_model(), config=_cfg(3, stage3_param_persistence_threshold=10**6))
    x = make_data(2, 8)[0][0, :4]
    with torch.no_grad():
        first = engine(x)
        kept = sum(p.numel() for p in engine.module.parameters())
        engine.empty_partition_cache()
        released = sum(p.numel() for p in engine.module.parameters())
        again = engine(x)
    return kept, released, torch.equal(first, again), all(p.ds_persist for p in engine.module.parameters())


def _unused_case(ignore):
    """A layer outside the forward: stage 2 with ignore_unused_parameters false raises on every rank."""
    import shardwise
    from shardwise.zero.stage12 import UnusedParametersError

    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"used": torch.nn.Linear(7, 3), "unused": torch.nn.Linear(7, 3)})
    engine, *_ = shardwise.initialize(model=model, config=_cfg(2, ignore_unused_parameters=ignore))
    x, y = make_data(2, 8)
    engine.backward(mse(model["used"](x[0, :4]), y[0, :4]))
    try:
        engine.step()
    except UnusedParametersError as exc:
        assert isinstance(exc, AssertionError) and "unused.weight" in str(exc), exc
        return "raised"
    return "stepped"


def _force_cpu_optimizer_case():
    import shardwise
    from shardwise.runtime.engine_compat import ZeroSetupError

    offload = {"offload_optimizer": {"device": "cpu"}}
    out = []
    for extra in ({"zero_force_ds_cpu_optimizer": True}, {}):
        model = _model()
        cfg = {**_cfg(1, **offload), **extra}
        cfg.pop("optimizer")
        try:
            shardwise.initialize(model=model, optimizer=torch.optim.Adam(model.parameters()), config=cfg)
            out.append("accepted")
        except ZeroSetupError as exc:
            assert "zero_force_ds_cpu_optimizer" in str(exc), exc
            out.append("refused")
    return out


class _Nested(torch.nn.Module):
    def __init__(self, size, device=None):
        super().__init__()
        self.inner = torch.nn.ModuleList([torch.nn.Linear(size, size, device=device)])


def _skip_init_case():
    """torch.nn.utils.skip_init under zero.Init: built on meta (children too), sharded once to_empty gave
    the whole tree storage."""
    import shardwise
    from torch.nn.utils import skip_init

    with shardwise.zero.Init():
        model = skip_init(_Nested, 10)
    params = list(model.parameters())
    with shardwise.zero.GatheredParameters(params):
        whole = [p.detach().clone().view(torch.int32) for p in params]  # (uninitialised: compare bits)
    return [p.ds_tensor.numel() for p in params], whole


def _body(rank, world):
    return {
        "set": {stage: _set_grad_case(stage, rank) for stage in (0, 1, 2, 3)},
        "local": _local_case(rank, world),
        "cache": _cache_case(rank),
        "unused": [_unused_case(False), _unused_case(True)],
        "force": _force_cpu_optimizer_case(),
        "skip_init": _skip_init_case(),
    }


def test_grad_access_cache_and_zero_checks_two_ranks():
    results = run_distributed(_body, 2, timeout=240)
    new = _new_grads(_model())
    # Reference: one process, one AdamW step from the same weights with the gradients that were set.
    ref = _model()
    for n, p in ref.named_parameters():
        p.grad = new[n].clone()
    torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0).step()
    for rank, r in enumerate(results):
        for stage, (read, after) in r["set"].items():
            for n, p in ref.named_parameters():
                torch.testing.assert_close(read[n], new[n], rtol=1e-6, atol=0, msg=f"stage {stage} {n} grad")
                torch.testing.assert_close(after[n], p.detach(), rtol=1e-6, atol=1e-7, msg=f"stage {stage} {n}")
        local = r["local"]
        assert local["chunks_ok"]
        for n in new:
            torch.testing.assert_close(local["grads"][n], new[n], rtol=1e-6, atol=0)
        c = local["c"]
        whole = torch.zeros(2 * c)
        whole[: ref[0].weight.numel()] = results[0]["local"]["exp_avg"].reshape(-1)
        torch.testing.assert_close(local["exp_avg_chunk"], whole[rank * c:(rank + 1) * c])
        kept, released, same, persist = r["cache"]
        assert kept == sum(p.numel() for p in ref.parameters()) and released == 0 and same and persist
        assert r["unused"] == ["raised", "stepped"]
        assert r["force"] == ["refused", "accepted"]
    torch.testing.assert_close(results[0]["local"]["exp_avg"], results[1]["local"]["exp_avg"])
    assert [r["skip_init"][0] for r in results] == [[50, 5], [50, 5]]  # ceil(numel / 2) elements per rank
    assert all(torch.equal(a, b) for a, b in zip(results[0]["skip_init"][1], results[1]["skip_init"][1]))
    # the fp32 chunks of the two ranks together: the weights the reference step gave, then zero padding
    fp32 = torch.cat([results[0]["local"]["fp32_chunk"], results[1]["local"]["fp32_chunk"]])
    numel = ref[0].weight.numel()
    torch.testing.assert_close(fp32[:numel], ref[0].weight.detach().reshape(-1), rtol=1e-6, atol=1e-7)
    assert torch.equal(fp32[numel:], torch.zeros(2 * c - numel))
