"""engine.compile() and the compile block: compiled training gives eager's losses under ZeRO 0-3, offload,
activation checkpointing, pipeline stages and tensor-parallel layers, with one graph, no graph break and
no recompilation (torch._dynamo's counters; ``error_on_recompile`` turns any recompilation into an error)."""

from __future__ import annotations

import pytest
import torch

from distributed import run_distributed
from models import base_config, make_data, make_model, mse

STEPS = 3


def _gpt_config():
    from shardwise.models.gpt import GPTConfig

    return GPTConfig(vocab_size=32, seq_len=8, hidden=16, n_layers=2, n_heads=2)


def _engine(case: dict, *, compiled: bool):
    import shardwise
    from shardwise.models.gpt import GPT, gpt_pipeline_module
    from shardwise.topology import ParallelGrid, PipeModelDataParallelTopology

    zero = {"stage": case.get("zero", 0), **case.get("offload", {})}
    if zero["stage"] == 3:  # units smaller than a block: each block's hooks are merged onto it
        zero["stage3_prefetch_bucket_size"] = 300
    cfg = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 4 // case.get("dp", 1) // case.get("micro", 1),
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "zero_optimization": zero, **case.get("config", {})}
    if compiled:
        cfg["compile"] = {"enabled": True, "backend": case.get("backend", "aot_eager")}
    topo = PipeModelDataParallelTopology(num_pp=case.get("pp", 1), num_mp=case.get("tp", 1), num_dp=case.get("dp", 1))
    torch.manual_seed(0)
    if case.get("pp", 1) > 1:
        model = gpt_pipeline_module(_gpt_config(), topology=topo, partition_method="uniform")
        return shardwise.initialize(model=model, config=cfg)[0]
    if case.get("tp", 1) == 1:
        return shardwise.initialize(model=GPT(_gpt_config()), config=cfg)[0]
    grid = ParallelGrid(topo)
    with grid.active():
        model = GPT(_gpt_config())
    return shardwise.initialize(model=model, mpu=grid, config=cfg)[0]


def _train(case: dict, *, compiled: bool) -> dict:
    """Losses of STEPS steps, and what torch._dynamo counted for them (compiled: any recompilation raises)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    engine = _engine(case, compiled=compiled)
    grid = engine.grid
    dp, d = grid.get_data_parallel_world_size(), grid.get_data_parallel_rank()
    gen = torch.Generator().manual_seed(1)
    losses, graphs = [], []
    for step in range(STEPS):  # after the first step, any recompilation raises
        with torch._dynamo.config.patch(error_on_recompile=step > 0):
            tokens = torch.randint(0, 32, (4, 9), generator=gen)[d * 4 // dp:(d + 1) * 4 // dp]
            if grid.get_pipe_parallel_world_size() > 1:
                batches = [(t[:, :-1], t[:, 1:]) for t in tokens.chunk(case["micro"])]
                losses.append(float(engine.train_batch(iter(batches))))
            else:
                loss = engine(tokens[:, :-1], tokens[:, 1:])
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())
        graphs.append(counters["stats"]["unique_graphs"])
    return {"losses": losses, "compiled": engine.is_compiled, "graphs": graphs, "breaks": dict(counters["graph_break"])}


def _check(case, eager, compiled):
    assert not eager["compiled"] and compiled["compiled"], case
    assert eager["graphs"][-1] == 0 and len(set(compiled["graphs"])) == 1, (case, compiled)  # all in step one
    if case.get("tp", 1) == 1:
        assert compiled["graphs"][0] == 1, (case, compiled)  # every block runs the one graph
        assert compiled["breaks"] == {}, (case, compiled["breaks"])
    else:  # tensor-parallel layers: the graph breaks at each collective (shardwise.comm is not traceable)
        assert all("lock" in reason or "collective" in reason for reason in compiled["breaks"]), compiled["breaks"]
    torch.testing.assert_close(compiled["losses"], eager["losses"], rtol=1e-5, atol=0, msg=str(case))


# ---------------------------------------------------------------- one process

def test_compiled_gpt_matches_eager_at_world_one():
    case = {"zero": 3, "offload": {"offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}}}
    _check(case, _train(case, compiled=False), _train(case, compiled=True))


def test_blocks_are_compiled_in_place_and_names_stay():
    import shardwise
    from shardwise.models.gpt import GPT
    from shardwise.runtime.compile import repeated_blocks

    model = GPT(_gpt_config())
    assert [type(b).__name__ for b in repeated_blocks(model)] == ["GPTBlock", "GPTBlock"]
    assert repeated_blocks(make_model()) == []  # no repeated blocks: compiled whole
    names = list(model.state_dict())
    engine, *_ = shardwise.initialize(model=model, config=base_config())
    engine.compile(backend="aot_eager")
    engine.compile(backend="aot_eager")  # a second call does nothing (DeepSpeed's behaviour)
    assert engine.is_compiled and list(model.state_dict()) == names
    assert [b for b in model if "forward" in vars(b)] == list(model)[1:3]


def test_inductor_on_a_model_without_repeated_blocks():
    """The one inductor case (C++ kernels on the CPU): a small MLP compiled whole, ZeRO-1."""
    import shardwise

    torch._dynamo.reset()
    x, y = make_data(STEPS, 4)
    runs = []
    for compiled in (False, True):
        cfg = base_config(zero_optimization={"stage": 1})
        if compiled:
            cfg["compile"] = {"enabled": True}  # the accelerator's backend: inductor
        engine, *_ = shardwise.initialize(model=make_model(), config=cfg)
        runs.append([])
        for s in range(STEPS):
            loss = mse(engine(x[s]), y[s])
            engine.backward(loss)
            engine.step()
            runs[-1].append(float(loss))
    assert "forward" in vars(engine.module)
    torch.testing.assert_close(runs[1], runs[0], rtol=1e-5, atol=0)


def test_refusals_name_the_problem():
    import shardwise
    from shardwise.config import ConfigError, load_config

    engine, *_ = shardwise.initialize(model=make_model(), config=base_config())
    with pytest.raises(ValueError, match="schedule.*DeepCompile"):
        engine.compile(schedule=[(0, ["z3"])])
    with pytest.raises(ValueError, match="compiled_autograd_enabled"):
        engine.compile(compiled_autograd_enabled=True)
    with pytest.raises(ValueError, match=r"compile.kwargs\) has \['fulgraph'\]"):
        engine.compile(backend="aot_eager", compile_kwargs={"fulgraph": True})
    from torch._inductor import config as inductor_config

    # torch's own patch context: pytest's monkeypatch undo left inductor's config without cpp.cxx, which broke
    # a later in-process compile (flex attention's mask in tests/test_sequence_parallel.py)
    with inductor_config.patch({"cpp.cxx": (None, "no-such-c++")}):
        with pytest.raises(ValueError, match=r"needs a C\+\+ compiler.*'no-such-c\+\+'.*apt-get install g\+\+"):
            engine.compile(backend="inductor")
    assert inductor_config.cpp.cxx != (None, "no-such-c++")
    assert not engine.is_compiled
    with pytest.raises(ConfigError, match="compile.deepcompile, compile.free_activation configure DeepCompile"):
        load_config({"compile": {"deepcompile": True, "free_activation": True}})
    load_config({"compile": {"deepcompile": False, "double_buffer": True}})  # DeepSpeed's defaults are fine


# ---------------------------------------------------------------- two processes

CASES = [
    {"dp": 2, "zero": 0},
    {"dp": 2, "zero": 1},
    {"dp": 2, "zero": 3},
    {"dp": 2, "zero": 2, "offload": {"offload_optimizer": {"device": "cpu"}}},
    {"dp": 2, "zero": 3, "offload": {"offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}}},
    {"tp": 2, "zero": 1},
    {"pp": 2, "micro": 2, "config": {"pipeline": {"activation_checkpoint_interval": 1}}},
]


def _compare_all(rank, world):
    import shardwise

    shardwise.init_distributed()
    return [(case, _train(case, compiled=False), _train(case, compiled=True)) for case in CASES]


def test_compiled_matches_eager_on_two_ranks():
    for rank_results in run_distributed(_compare_all, 2, timeout=300):
        for case, eager, compiled in rank_results:
            _check(case, eager, compiled)
