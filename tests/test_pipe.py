"""Pipeline parallelism: parity with one-process training of the same layers (fp32, rtol 1e-6 per
step), errors, and the pipeline example. Many cases share one spawn (``run_subtests``)."""
from __future__ import annotations

import pytest
import torch

from distributed import DistributedTestError, run_distributed, run_subtests
from pipe_models import batch, layer_specs, reference

STEPS, ROWS = 3, 2  # rows of one micro-batch per data-parallel rank


def _config(*, micro: int, dp: int, stage: int = 0, clip: float = 0.0, extra=None, rows: int = ROWS) -> dict:
    cfg = {
        "train_batch_size": rows * micro * dp, "train_micro_batch_size_per_gpu": rows,
        "gradient_accumulation_steps": micro, "gradient_clipping": clip,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 64},
    }
    cfg.update(extra or {})
    return cfg


def _train(case: dict):
    import shardwise
    from shardwise.pipe import PipelineModule

    stages, micro = case["stages"], case.get("micro", 4)
    kw = {}
    if case.get("reentrant"):  # a user's reentrant checkpoint: the first stage's inputs must require grad
        import functools
        kw["activation_checkpoint_func"] = functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=True)
    model = PipelineModule(layer_specs(case.get("tied", False)), num_stages=stages,
                           loss_fn=torch.nn.CrossEntropyLoss(), seed_layers=True,
                           partition_method=case.get("partition", "parameters"),
                           schedule=case.get("schedule"), virtual_stages=case.get("virtual", 1), **kw)
    dp = torch.distributed.get_world_size() // stages
    extra = {"pipeline": {"activation_checkpoint_interval": case["ckpt"]}} if case.get("ckpt") else {}
    extra.update(case.get("config", {}))
    engine, *_ = shardwise.initialize(model=model, model_parameters=model.parameters(),
                                      config=_config(micro=micro, dp=dp, stage=case.get("zero", 0),
                                                     clip=case.get("clip", 0.0), extra=extra))
    assert isinstance(engine, shardwise.PipelineEngine)
    if case.get("set_interval"):  # checkpointing switched on after initialize, every block recomputed
        assert not engine._reentrant_activation_checkpointing()
        engine.module.set_checkpoint_interval(case["set_interval"])
        assert model.is_checkpointable_results == [True] * len(model.is_checkpointable_results) != []
        assert engine._reentrant_activation_checkpointing() == bool(case.get("reentrant"))
        with pytest.raises(ValueError, match="interval must be an integer >= 0"):
            engine.module.set_checkpoint_interval(-1)
    d = engine.grid.get_data_parallel_rank()
    losses, norms = [], []
    evals = []
    for step in range(STEPS):
        x, y = batch(step, micro, ROWS * dp)
        rows = slice(d * ROWS, (d + 1) * ROWS)
        data = [(x[i, rows], y[i, rows]) for i in range(micro)]
        if case.get("eval_train"):  # evaluation and training reduce the loss through the same code
            evals.append(float(engine.eval_batch(iter(data))))
        loss = engine.train_batch(iter(data))
        losses.append(float(loss))
        norms.append(engine.get_global_grad_norm())
    out = {"losses": losses, "norms": norms, "meta": engine._act_in.metadata_received,
           "skipped": engine.skipped_steps, "scale": engine.cur_scale,
           "ckpt_interval": model.activation_checkpoint_interval}
    out["evals"] = evals
    if case.get("double_batch"):  # set_train_batch_size: the next train_batch consumes twice the micro-batches
        engine.set_train_batch_size(2 * engine.train_batch_size())
        x, y = batch(50, 2 * micro, ROWS * dp)
        data = [(x[i, rows], y[i, rows]) for i in range(2 * micro)]
        taken = []

        def counting():
            for item in data:
                taken.append(1)
                yield item
        want = float(engine.eval_batch(iter(data)))
        out["doubled"] = {"gas": engine.gradient_accumulation_steps(), "eval": want,
                          "loss": float(engine.train_batch(counting())), "taken": len(taken),
                          "samples": engine.global_samples, "steps": engine.global_steps}
    if case.get("eval"):
        x, y = batch(99, micro, ROWS * dp)
        loss, logits = engine.eval_batch(iter([(x[i, rows], y[i, rows]) for i in range(micro)]), return_logits=True)
        out["eval"] = float(loss)
        out["logits"] = logits
    return out


CASES_2 = [
    {"name": "2 stages 1F1B", "stages": 2, "eval": True},
    {"name": "2 stages GPipe", "stages": 2, "schedule": "gpipe"},
    {"name": "2 stages clipped", "stages": 2, "clip": 0.05},
    {"name": "2 stages activation checkpointing", "stages": 2, "ckpt": 1},
    {"name": "user's reentrant checkpoint, interval set after initialize", "stages": 2, "reentrant": True,
     "set_interval": 1},
    {"name": "accumulation 8", "stages": 2, "micro": 8},
    {"name": "tied", "stages": 2, "tied": True, "partition": "uniform", "clip": 0.05},
    {"name": "interleaved 2x2 virtual", "stages": 2, "virtual": 2, "partition": "uniform"},
    # 16-bit: not bitwise, so compared loosely; an fp16 overflow on any stage skips the step on all.
    {"name": "bf16", "stages": 2, "config": {"bf16": {"enabled": True}}, "rtol": 2e-2},
    {"name": "fp16 overflow", "stages": 2, "config": {"fp16": {"enabled": True, "initial_scale_power": 40}},
     "rtol": 2e-2, "skipped": True},
]
CASES_4 = [
    {"name": "4 stages", "stages": 4, "micro": 8},
    {"name": "pipe 2 x data 2", "stages": 2, "eval_train": True, "double_batch": True},
    {"name": "pipe 2 x data 2 ZeRO 1", "stages": 2, "zero": 1, "clip": 0.05},
    {"name": "pipe 2 x data 2 ZeRO 2", "stages": 2, "zero": 2},
    {"name": "pipe 2 x data 2 ZeRO 3", "stages": 2, "zero": 3, "clip": 0.05},
]


def _steps(engine, first: int, count: int, *, micro: int, rows_total: int, pipeline: bool = True):
    dp = engine.dp_world_size
    d = engine.grid.get_data_parallel_rank()
    per = rows_total // dp
    sl = slice(d * per, (d + 1) * per)
    losses = []
    for step in range(first, first + count):
        x, y = batch(step, micro, rows_total)
        if pipeline:
            losses.append(float(engine.train_batch(iter([(x[i, sl], y[i, sl]) for i in range(micro)]))))
        else:
            total = 0.0
            for i in range(micro):
                loss = torch.nn.functional.cross_entropy(engine(x[i, sl]), y[i, sl])
                engine.backward(loss)
                engine.step()
                total += float(loss)
            mean = torch.tensor([total / micro / dp], dtype=torch.float64)
            if dp > 1:
                torch.distributed.all_reduce(mean, group=engine.dp_group)
            losses.append(float(mean))
    return losses


def _pipe_engine(stages: int, rows: int, micro: int = 4, zero: int = 0, extra=None):
    import shardwise
    from shardwise.pipe import PipelineModule

    model = PipelineModule(layer_specs(), num_stages=stages, loss_fn=torch.nn.CrossEntropyLoss(), seed_layers=True)
    dp = torch.distributed.get_world_size() // stages
    engine, *_ = shardwise.initialize(model=model, model_parameters=model.parameters(),
                                      config=_config(micro=micro, dp=dp, rows=rows, stage=zero, extra=extra))
    return engine


def _params(engine) -> dict:
    return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def _ckpt_agreement_async(rank: int, root: str) -> dict:
    """A pipeline save goes through the ordinary path (2 stages, ZeRO 1): a failure on rank 1 is named
    on every rank, and so are rank 0 refusing client_state and a damaged rank-1 file on load; asked to,
    it saves asynchronously."""
    import resource
    import signal
    import threading
    from pathlib import Path

    from shardwise.checkpoint import LoadFailed, SaveFailed, writer

    out = {}
    a = _pipe_engine(2, rows=2, zero=1)
    _steps(a, 0, 1, micro=4, rows_total=2)
    a.save_checkpoint(root, tag="good")
    _steps(a, 1, 1, micro=4, rows_total=2)
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    if rank == 1:  # rank 1 may not write files over 1 KiB: the kernel refuses its writes (EFBIG)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1024, limit[1]))
    try:
        a.save_checkpoint(root, tag="bad")
        out["save_error"] = None
    except SaveFailed as e:
        out["save_error"] = str(e)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limit)
    out["latest_after_failure"] = Path(root, "latest").read_text()
    try:  # rank 0 alone describes client_state: the others learn why it refused
        a.save_checkpoint(root, tag="bad_client", client_state={"bad": object()})
        out["client_error"] = None
    except Exception as e:
        out["client_error"] = f"{type(e).__name__}: {e}"

    # rank 1's optimizer file, truncated: only rank 1 reads it, every rank names it
    damaged = Path(root, "good", "optim_rank1.safetensors")
    torch.distributed.barrier()
    if rank == 0:
        data = damaged.read_bytes()
        damaged.write_bytes(data[:100])
    torch.distributed.barrier()
    try:
        _pipe_engine(2, rows=2, zero=1).load_checkpoint(root, tag="good")
        out["load_error"] = None
    except (ValueError, FileNotFoundError) as e:
        out["load_error"] = f"{type(e).__name__}: {e}"
        out["load_error_is_agreed"] = isinstance(e, LoadFailed)
    torch.distributed.barrier()
    if rank == 0:
        damaged.write_bytes(data)
    torch.distributed.barrier()

    # asynchronous: the files are written after save_checkpoint returns (held back until then)
    b = _pipe_engine(2, rows=2, zero=1, extra={"checkpoint": {"writer": {"decoupled": True}}})
    _steps(b, 0, 2, micro=4, rows_total=2)
    at_save = _params(b)
    returned = threading.Event()
    real_write_files = writer.SavePlan.write_files

    def slow_write_files(plan):
        returned.wait(timeout=30)
        return real_write_files(plan)

    writer.SavePlan.write_files = slow_write_files
    try:
        b.save_checkpoint(root, tag="async")
        out["busy_after_return"] = b.checkpoint_writer.busy
        returned.set()
    finally:
        writer.SavePlan.write_files = real_write_files
    _steps(b, 2, 1, micro=4, rows_total=2)  # changes every weight while "async" is being written
    b.wait_for_checkpoint()
    c = _pipe_engine(2, rows=2, zero=1)
    c.load_checkpoint(root)  # 'latest': the asynchronous save
    out["async_saved"], out["async_loaded"] = at_save, _params(c)
    out["async_steps"] = c.global_steps
    return out


def _ckpt_save_and_reload(ckpt_dir: str):
    """Save at 2 stages x 2 replicas (ZeRO 1), then load at 4 stages x 1 replica: the same losses follow."""
    a = _pipe_engine(2, rows=2, zero=1)
    before = _steps(a, 0, 2, micro=4, rows_total=4)
    a.save_checkpoint(ckpt_dir, tag="t")
    after = _steps(a, 2, 2, micro=4, rows_total=4)
    b = _pipe_engine(4, rows=4)
    b.load_checkpoint(ckpt_dir, tag="t")
    resumed = _steps(b, 2, 2, micro=4, rows_total=4)
    # Into a non-pipelined model (plain nn.Sequential, 4 data-parallel ranks), and back from it.
    import shardwise
    from shardwise.pipe.module import build_sequential

    c, *_ = shardwise.initialize(model=build_sequential(layer_specs(), seed_layers=True, base_seed=0),
                                 config=_config(micro=4, dp=4, rows=1))
    c.load_checkpoint(ckpt_dir, tag="t")
    c.save_checkpoint(ckpt_dir, tag="plain")
    plain = _steps(c, 2, 2, micro=4, rows_total=4, pipeline=False)
    d = _pipe_engine(2, rows=2, extra={"checkpoint": {"writer": {"decoupled": True}}})
    d.load_checkpoint(ckpt_dir, tag="plain")
    back = _steps(d, 2, 2, micro=4, rows_total=4)
    return {"before": before, "after": after, "resumed": resumed, "global_steps": b.global_steps,
            "plain": plain, "back": back, "async_failure": _failing_async_save(d, ckpt_dir)}


def _failing_async_save(engine, ckpt_dir: str) -> str | None:
    """An asynchronous save whose files rank 3 cannot write (its file-size limit at 1 KiB: EFBIG). Ranks
    3 and 0 (whose commit waits for rank 3) learn it from their writer; ranks 1 and 2 from the others."""
    import resource
    import signal

    from shardwise.checkpoint import SaveFailed

    limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    if torch.distributed.get_rank() == 3:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1024, limit[1]))
    try:
        engine.save_checkpoint(ckpt_dir, tag="async_bad")
        engine.wait_for_checkpoint()
        return None
    except (SaveFailed, RuntimeError) as e:
        return f"{type(e).__name__}: {e}"
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limit)


def _plain_load(rank, world, ckpt_dir):
    import shardwise
    from shardwise.pipe.module import build_sequential

    model = build_sequential(layer_specs(), seed_layers=True, base_seed=0)  # other weights: the load replaces them
    engine, *_ = shardwise.initialize(model=model, config=_config(micro=4, dp=1, rows=4))
    engine.load_checkpoint(ckpt_dir, tag="t")
    return {"resumed": _steps(engine, 2, 2, micro=4, rows_total=4, pipeline=False), "steps": engine.global_steps}


def _body(rank, world, cases, ckpt_dir=None):
    out = run_subtests(lambda c: (c["name"], _train(c)), cases)
    if ckpt_dir:
        out.append(("checkpoint", _ckpt_save_and_reload(ckpt_dir)))
    if world == 4:  # an exhausted iterator on the first and last stage stops the middle ones too
        import shardwise
        from shardwise.pipe import PipelineError, PipelineModule

        model = PipelineModule(layer_specs(), num_stages=4, loss_fn=torch.nn.CrossEntropyLoss())
        engine, *_ = shardwise.initialize(model=model, model_parameters=model.parameters(),
                                          config=_config(micro=4, dp=1))
        x, y = batch(0, 4, ROWS)
        try:
            engine.train_batch(iter([(x[i], y[i]) for i in range(3)]))
        except PipelineError as e:
            out.append(("exhausted", str(e)))
    return out


def _check(results, cases, dp_of):
    for case in cases:
        per_rank = [dict(r)[case["name"]] for r in results]
        micro = case.get("micro", 4)
        dp = dp_of(case)
        ref, model = reference(steps=STEPS, micro=micro, rows=ROWS * dp, clip=case.get("clip", 0.0),
                               tied=case.get("tied", False))
        for r, got in enumerate(per_rank):
            if case.get("skipped"):  # every step overflows at this scale: all stages skip it together
                assert got["skipped"] == STEPS and got["scale"] < 2.0 ** 40, got
                untrained, _ = reference(steps=STEPS, micro=micro, rows=ROWS * dp, lr=0.0)
                torch.testing.assert_close(got["losses"], untrained, rtol=case["rtol"], atol=0)
                continue
            torch.testing.assert_close(got["losses"], ref, rtol=case.get("rtol", 1e-6), atol=0,
                                       msg=lambda m: f"{case['name']} rank {r}: {m}")
            assert got["norms"] == per_rank[0]["norms"], (case["name"], "every rank reports the global norm")
        if case.get("ckpt"):
            assert per_rank[0]["ckpt_interval"] == case["ckpt"]
        for r, got in enumerate(per_rank):
            if case.get("eval_train"):  # the same weights and micro-batches: the same loss
                assert got["evals"] == pytest.approx(got["losses"], rel=1e-6, abs=0), (case["name"], r)
            if case.get("double_batch"):
                d = got["doubled"]
                assert d["gas"] == 2 * micro and d["taken"] == 2 * micro, (case["name"], r, d)
                assert d["loss"] == pytest.approx(d["eval"], rel=1e-6, abs=0), (case["name"], r, d)
                assert d["steps"] == STEPS + 1
                assert d["samples"] == STEPS * ROWS * micro * dp_of(case) + 2 * ROWS * micro * dp_of(case)
        # Shapes are described once per channel (they never change here).
        assert max(r["meta"] for r in per_rank) == 1 or case.get("virtual"), (case["name"], per_rank)
        if case.get("eval"):
            x, y = batch(99, micro, ROWS * dp)
            with torch.no_grad():
                want = sum(float(torch.nn.functional.cross_entropy(model(x[i]), y[i])) for i in range(micro)) / micro
            for r, got in enumerate(per_rank):
                assert got["eval"] == pytest.approx(want, rel=1e-6)
                if r == len(per_rank) - 1:  # the last stage returns its outputs
                    with torch.no_grad():
                        torch.testing.assert_close(torch.stack(got["logits"]), torch.stack([model(x[i]) for i in range(micro)]),
                                                   rtol=1e-5, atol=1e-6)
                else:
                    assert got["logits"] is None


def _two_rank_body(rank, world, root):
    return _body(rank, world, CASES_2) + [("errors", _errors(rank, world)),
                                          ("checkpoint", _ckpt_agreement_async(rank, root))]


def test_pipeline_parity_two_ranks_and_errors(tmp_path):
    root = tmp_path / "ckpt"
    results = run_distributed(_two_rank_body, 2, args=(str(root),), timeout=300)
    _check(results, CASES_2, lambda c: 2 // c["stages"])
    _check_errors([dict(r)["errors"] for r in results])
    _check_checkpoint([dict(r)["checkpoint"] for r in results], root, tmp_path)


def _check_checkpoint(results, root, tmp_path):
    import subprocess
    import sys

    from safetensors.torch import load_file

    for rank, r in enumerate(results):
        error = r["save_error"]
        assert error is not None, f"rank {rank}: the save with rank 1 unable to write passed"
        assert "saving bad failed" in error and "rank 1 could not write" in error, (rank, error)
        assert str(root / ".tmp.bad") in error, (rank, error)
        assert r["latest_after_failure"] == "good"
        assert r["client_error"] is not None and "cannot save object at 'client.bad'" in r["client_error"], \
            (rank, r["client_error"])
        assert r["client_error"].startswith("SaveFailed: saving bad_client failed") == (rank == 1), r["client_error"]
        damaged = str(root / "good" / "optim_rank1.safetensors")
        assert r["load_error"] is not None and damaged in r["load_error"], (rank, r["load_error"])
        assert "truncated" in r["load_error"], (rank, r["load_error"])
        assert r["load_error_is_agreed"] == (rank == 0), (rank, r["load_error"])  # rank 1 raises its own
        assert r["busy_after_return"], f"rank {rank}: save_checkpoint waited for the writing (not asynchronous)"
        assert r["async_saved"].keys() == r["async_loaded"].keys()
        for name, value in r["async_saved"].items():
            assert torch.equal(r["async_loaded"][name], value), (rank, name)
        assert r["async_steps"] == 2
    assert (root / "latest").read_text() == "async"
    assert sorted(p.name for p in root.iterdir() if not p.name.startswith(".")) == \
        ["async", "good", "latest", "zero_to_fp32.py"]
    # zero_to_fp32.py, run on its own, rebuilds every stage's fp32 weights of the asynchronous save
    out = tmp_path / "fp32"
    subprocess.run([sys.executable, str(root / "zero_to_fp32.py"), str(root), str(out), "--safe_serialization"],
                   check=True, capture_output=True, cwd=tmp_path, env={"PATH": "/usr/bin:/bin"})
    whole = {}
    for f in sorted(out.glob("*.safetensors")):
        whole.update(load_file(str(f)))
    saved = {**results[0]["async_saved"], **results[1]["async_saved"]}
    assert whole.keys() == saved.keys()
    for name, value in saved.items():
        assert torch.equal(whole[name], value), name


def test_pipeline_parity_four_ranks(tmp_path):
    results = run_distributed(_body, 4, args=(CASES_4, str(tmp_path)), timeout=300)
    _check(results, CASES_4, lambda c: 4 // c["stages"])
    ref, _ = reference(steps=4, micro=4, rows=4)
    for r in results:
        ck = dict(r)["checkpoint"]
        torch.testing.assert_close(ck["before"] + ck["after"], ref, rtol=1e-6, atol=0)
        # Saved at 2 stages, loaded at 4: the losses continue as without the interruption.
        torch.testing.assert_close(ck["resumed"], ck["after"], rtol=1e-6, atol=0)
        torch.testing.assert_close(ck["plain"], ck["after"], rtol=1e-6, atol=0)  # plain model, 4 replicas
        torch.testing.assert_close(ck["back"], ck["after"], rtol=1e-6, atol=0)  # plain checkpoint -> pipeline
        assert ck["global_steps"] == 4
    for rank, r in enumerate(results):  # every rank names rank 3's failure, none waits for it
        error = dict(r)["checkpoint"]["async_failure"]
        assert error is not None, f"rank {rank}: the asynchronous save that rank 3 could not write passed"
        named = "File too large" if rank == 3 else "rank 3 could not write its files into"  # rank 3: its own
        assert named in error, (rank, error)
        assert error.startswith("SaveFailed") == (rank in (1, 2)), (rank, error)
    assert (tmp_path / "latest").read_text() == "plain"
    # ... and into the same layers as a plain nn.Sequential in one process (no pipeline).
    plain = run_distributed(_plain_load, 1, args=(str(tmp_path),), timeout=120)[0]
    torch.testing.assert_close(plain["resumed"], dict(results[0])["checkpoint"]["after"], rtol=1e-6, atol=0)
    assert plain["steps"] == 4
    for rank, r in enumerate(results):
        msg = dict(r)["exhausted"]
        want = "ran out after 3 of the 4 micro-batches" if rank in (0, 3) else "rank(s) [0, 3]"
        assert want in msg, (rank, msg)


class _Dict(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x):
        return {"h": self.fc(x)}


def _errors(rank, world):
    """Each misuse raises a clear error on every rank that takes part, without hanging the others."""
    import shardwise
    from shardwise.pipe import LayerSpec, PipelineError, PipelineModule

    got = {}

    def expect(name, fn, exc=PipelineError):
        try:
            fn()
        except exc as e:
            got[name] = str(e)
        else:
            got[name] = None

    expect("more stages than layers", lambda: PipelineModule([LayerSpec(torch.nn.Linear, 8, 8)], num_stages=2))
    expect("not divisible", lambda: PipelineModule(layer_specs(), num_stages=3))
    expect("plain model with pipeline config", lambda: shardwise.initialize(
        model=torch.nn.Linear(2, 2), config={**_config(micro=1, dp=2), "pipeline": {"activation_checkpoint_interval": 1}}),
        ValueError)
    model = PipelineModule([LayerSpec(_Dict), LayerSpec(torch.nn.Linear, 8, 4)], num_stages=2,
                           loss_fn=torch.nn.CrossEntropyLoss(), partition_method="uniform")
    engine, *_ = shardwise.initialize(model=model, model_parameters=model.parameters(), config=_config(micro=4, dp=1))
    x, y = batch(0, 4, ROWS)
    data = [(x[i], y[i]) for i in range(4)]
    expect("exhausted", lambda: engine.train_batch(iter(data[:2])))
    expect("forward", lambda: engine(x[0]))
    expect("backward", lambda: engine.backward(torch.ones(())))
    expect("step", lambda: engine.step())
    if rank == 0:  # stage 0 refuses the dict before sending anything; stage 1 only joins the data check
        expect("non-tensor output", lambda: engine.train_batch(iter(data)))
    else:
        engine.set_dataiterator(iter(data))
        engine._load_batches(4)
    return got


def _check_errors(results):
    for rank, got in enumerate(results):
        assert "1 layers cannot fill 2 pipeline stages" in got["more stages than layers"]
        assert "num_stages (3) must divide the world size (2)" in got["not divisible"]
        assert "'pipeline' block but the model is not a shardwise.pipe.PipelineModule" in \
            got["plain model with pipeline config"]
        assert "ran out" in got["exhausted"], got  # every stage, not only those reading data
        for call in ("forward", "backward", "step"):
            assert f"engine.{call}() is not available on a pipeline engine" in got[call]
            assert "train_batch" in got[call]
    msg = results[0]["non-tensor output"]
    assert "layer 0 (_Dict) returned a dict" in msg and "tensor or a tuple of tensors" in msg, msg


def test_stage_outputs_that_cannot_travel_are_refused_naming_the_stage():
    from shardwise.comm.p2p import WIRE_DTYPES
    from shardwise.pipe import PipelineError
    from shardwise.pipe.engine import as_tensors

    assert as_tensors(torch.ones(2), "stage 0")[1] is True
    tensors, single = as_tensors([torch.ones(2), torch.zeros(1, dtype=torch.int64)], "stage 0")
    assert len(tensors) == 2 and single is False
    assert torch.complex64 not in WIRE_DTYPES
    with pytest.raises(PipelineError, match="stage 3's output returned a tensor of dtype torch.complex64"):
        as_tensors((torch.ones(2), torch.ones(2, dtype=torch.complex64)), lambda: "stage 3's output")
    with pytest.raises(PipelineError, match="returned a dict"):
        as_tensors({"x": torch.ones(2)}, "stage 1")
