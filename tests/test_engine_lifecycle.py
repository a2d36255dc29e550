"""Engines that give their memory back: building an engine, training and dropping it, over and over in one
process, leaves nothing of it alive (no engine, strategy or optimizer object, no tensor), whether or not the
user keeps the model; ``engine.destroy()`` (DeepSpeed's) takes every hook off the model at once.

Every ZeRO stage, CPU offload, the pipeline engine and MoE, on 2 gloo ranks in one spawn."""

from __future__ import annotations

import ctypes
import gc
import os
import time
import weakref

import torch

from distributed import run_distributed, run_subtests

HIDDEN = 48
STEPS = 3
# The object kinds whose survival would mean a leak (type names; any module under shardwise counts too).
_ENGINE_KINDS = ("Engine", "PipelineEngine", "Strategy", "Reducer", "Coordinator", "Unit", "PartitionedOptimizer")


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(HIDDEN, HIDDEN)
        self.b = torch.nn.Linear(HIDDEN, HIDDEN)
        self.c = torch.nn.Linear(HIDDEN, 1)

    def forward(self, x):
        x = x.to(self.a.weight.dtype)
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x))))).squeeze(-1).float()


def _config(case: dict) -> dict:
    zero = {"stage": case.get("stage", 0), "reduce_bucket_size": 2048, "stage3_prefetch_bucket_size": 3000,
            "stage3_param_persistence_threshold": 0}
    if case.get("offload"):
        zero["offload_optimizer"] = {"device": "cpu"}
        if zero["stage"] == 3:
            zero["offload_param"] = {"device": "cpu"}
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": case.get("gas", 1),
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "zero_optimization": zero}
    if case.get("bf16"):
        cfg["bf16"] = {"enabled": True}
    cfg.update(case.get("extra", {}))
    return cfg


def _data(step: int):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(4, HIDDEN, generator=g), torch.randn(4, generator=g)


def _build(case: dict):
    import shardwise

    kind = case.get("kind", "dense")
    if kind == "pipe":
        from pipe_models import layer_specs

        from shardwise.pipe import PipelineModule

        model = PipelineModule(layer_specs(), num_stages=2, loss_fn=torch.nn.CrossEntropyLoss(), seed_layers=True)
        cfg = _config(case)
        cfg.update(train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=2)
        engine, opt, _, _ = shardwise.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    elif kind == "moe":
        from test_moe import Net as MoENet

        from shardwise.moe.utils import split_params_into_different_moe_groups_for_optimizer

        model = MoENet(ep_size=2)
        groups = split_params_into_different_moe_groups_for_optimizer({"params": list(model.parameters()),
                                                                       "name": "all"})
        cfg = _config(case)
        cfg.pop("optimizer")
        cfg["train_micro_batch_size_per_gpu"] = 2
        engine, opt, _, _ = shardwise.initialize(model=model, optimizer=torch.optim.Adam(groups, lr=0.01), config=cfg)
    else:
        model = Net()
        engine, opt, _, _ = shardwise.initialize(model=model, config=_config(case))
    return engine, opt, model


def _train(engine, case: dict, rank: int) -> None:
    kind = case.get("kind", "dense")
    for step in range(STEPS):
        if kind == "pipe":
            from pipe_models import batch

            x, y = batch(step, 2, 2)
            engine.train_batch(iter([(x[i], y[i]) for i in range(2)]))
            continue
        for _ in range(case.get("gas", 1)):
            if kind == "moe":
                from test_moe import _data as moe_data

                xs, ys = moe_data(step, 2)
                loss = engine(xs[rank], ys[rank])
            else:
                x, y = _data(step)
                loss = ((engine(x) - y) ** 2).mean()
            engine.backward(loss)
            engine.step()


def _collect() -> None:
    """Collect until nothing is left to collect (what a finalizer frees goes in the next pass)."""
    for _ in range(5):
        if gc.collect() == 0:
            return


def _live_shardwise() -> dict[str, int]:
    _collect()
    out: dict[str, int] = {}
    for o in gc.get_objects():
        mod = getattr(type(o), "__module__", None)
        if isinstance(mod, str) and mod.startswith("shardwise"):
            name = type(o).__qualname__
            out[name] = out.get(name, 0) + 1
    return out


def _live_tensors() -> tuple[int, int]:
    _collect()
    n = nbytes = 0
    for o in gc.get_objects():
        if isinstance(o, torch.Tensor):
            n += 1
            try:
                nbytes += o.untyped_storage().nbytes()
            except (RuntimeError, NotImplementedError):
                pass
    return n, nbytes


def _rss() -> int:
    """Resident bytes, after glibc hands its free lists back (``malloc_trim``): what is live, not what the
    allocator keeps for reuse (without it the reading moves by a few MB either way from one engine to the next)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _strategies(engine) -> list:
    s = engine.strategy
    return [s, *getattr(s, "strategies", ())]


def _cycle(case: dict, rank: int, *, keep_model: bool, destroy: bool):
    """Build, train and drop one engine; the weak references to what must not outlive it, and the model
    when ``keep_model``."""
    engine, opt, model = _build(case)
    _train(engine, case, rank)
    refs = {"engine": weakref.ref(engine), "optimizer": weakref.ref(opt)}
    refs.update({f"strategy{i}": weakref.ref(s) for i, s in enumerate(_strategies(engine))})
    if destroy:
        engine.destroy()
        assert not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules()), "module hooks left"
        assert not any(getattr(p, "_post_accumulate_grad_hooks", None) for p in model.parameters()), \
            "gradient hooks left"
    del engine, opt
    if not keep_model:
        del model
        model = None
    _collect()
    alive = [name for name, r in refs.items() if r() is not None]
    assert not alive, f"alive after the engine was dropped: {alive}"
    return model


def _leak_case(case: dict, rank: int, world: int):
    """A warm-up engine, frozen with all it left (``gc.freeze``: later collections and counts walk only what
    came after); one more engine, after which the shardwise objects and the tensors alive are the baseline
    (the process-wide ones, as the active grid, are then the second engine's); then three more dropped
    engines, one with the model kept by the caller (the engine, its strategy and optimizer still go) and one
    destroyed with ``destroy()``: nothing of them accumulates over the baseline."""
    _cycle(case, rank, keep_model=False, destroy=False)
    _collect()
    gc.freeze()
    try:
        _cycle(case, rank, keep_model=False, destroy=False)
        objects, tensors = _live_shardwise(), _live_tensors()

        def check(what: str) -> None:
            grown = {k: v - objects.get(k, 0) for k, v in _live_shardwise().items() if v > objects.get(k, 0)}
            assert not grown, f"shardwise objects accumulated over {what}: {grown}"
            after = _live_tensors()
            for _ in range(10):  # (a leak stays; a tensor a finishing background thread still holds goes)
                if after[0] <= tensors[0] and after[1] <= tensors[1]:
                    break
                time.sleep(0.2)
                after = _live_tensors()
            assert after[0] <= tensors[0] and after[1] <= tensors[1], \
                f"live tensors grew over {what}: {tensors} -> {after} (count, bytes)"

        _cycle(case, rank, keep_model=False, destroy=False)
        check("one more dropped engine")
        kept = _cycle(case, rank, keep_model=True, destroy=False)
        assert kept is not None
        del kept
        _cycle(case, rank, keep_model=True, destroy=True)
        check("two more engines, one kept model and one destroy()")
        engines = [k for k in objects if any(x in k for x in _ENGINE_KINDS)]
        assert not engines, f"engine objects alive after a dropped engine: {engines}"
    finally:
        gc.unfreeze()
    return True


CASES = [
    {"stage": 0},
    {"stage": 1},
    {"stage": 2, "gas": 2},
    {"stage": 3},
    {"stage": 2, "offload": True},
    {"stage": 3, "offload": True},
    {"stage": 1, "bf16": True},
    {"kind": "pipe", "stage": 1},
    {"kind": "moe", "stage": 2},
    {"kind": "moe", "stage": 3},
]


def _body(rank: int, world: int):
    return run_subtests(_leak_case, CASES, rank, world)


def test_dropped_engines_leave_nothing_alive():
    # (a fresh interpreter per rank: the live-tensor count is of this process alone, not of modules a fork
    # server loaded and froze out of the garbage collector)
    assert run_distributed(_body, 2, timeout=240, fresh_interpreter=True) == [[True] * len(CASES)] * 2


def _rss_body(rank: int, world: int, engines: int):
    """Resident memory over ``engines`` engines of a 0.4M-parameter model (1.6 MB of fp32 weights, about
    6.4 MB of model states with Adam) at ZeRO-1 and ZeRO-3: after a warm-up of 2, the growth per engine."""
    import shardwise

    class Wide(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.a, self.b = torch.nn.Linear(448, 448), torch.nn.Linear(448, 448)

        def forward(self, x):
            return self.b(torch.tanh(self.a(x))).sum(-1)

    def one(stage: int) -> None:
        engine, *_ = shardwise.initialize(model=Wide(), config={
            "train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}})
        for _ in range(STEPS):
            engine.backward((engine(torch.randn(4, 448)) ** 2).mean())
            engine.step()

    out = {}
    for stage in (1, 3):
        for _ in range(2):
            one(stage)
        _collect()
        start = _rss()
        for _ in range(engines):
            one(stage)
        _collect()
        out[stage] = (_rss() - start) / engines
    return out


def test_resident_memory_flat_over_engines():
    per_rank = run_distributed(_rss_body, 2, args=(4,), timeout=240)
    # A leaked engine costs its model states: 3.2 MB (ZeRO-3) to 5.6 MB (ZeRO-1) per engine on main before.
    grown = {stage: round(r[stage] / 1e6, 2) for r in per_rank for stage in r}
    assert all(v < 0.5 for v in grown.values()), f"resident memory grew per engine (MB): {per_rank}"
