"""Tensor parallelism.

* Column/Row/Vocab layers, sequence-parallel mappings and vocab-parallel cross-entropy equal their
  one-process torch counterparts (forward and backward) at tensor size 2 and 4;
* topology arithmetic without processes; the RNG tracker;
* 3D: the reference GPT (shardwise.models.gpt) on data x pipe x tensor grids gives the same losses
  and gathered parameters as one process (fp32), clipping by the global norm; a checkpoint saved on
  one grid loads on another and training continues identically.

Two spawns in all (8 ranks, then 4 ranks running the layer checks and the 4-rank grids)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from distributed import run_distributed, run_subtests
from shardwise.models.gpt import GPT, GPTConfig
from shardwise.topology import PipeModelDataParallelTopology, ProcessTopology


# -- topology arithmetic (no processes) ---------------------------------------------------------
def test_pipe_model_data_layout_matches_deepspeed():
    topo = PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=2)
    assert topo.axes == ("pipe", "data", "model") and topo.dims == (2, 2, 2)
    # DeepSpeed's layout: model fastest, then data, then pipe.
    assert topo.get_coord(5) == topo.ProcessCoord(pipe=1, data=0, model=1) and topo.get_coord(5)["data"] == 0
    assert topo.get_rank(pipe=1, data=1, model=0) == 6
    assert topo.axis_groups("model") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert topo.axis_groups("data") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert topo.axis_groups("pipe") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert topo.get_axis_comm_lists("expert") == []
    for r in range(8):
        assert topo.get_rank(**topo.get_coord(r)) == r


def test_topology_has_deepspeeds_methods():
    topo = ProcessTopology(axes=["a", "b", "c"], dims=[2, 2, 2])  # DeepSpeed's callers pass lists
    assert topo.world_size() == topo.world_size == 8
    assert topo.get_axis_list("b", 1) == [2, 3, 6, 7] and topo.get_axis_list(axis="a", idx=0) == [0, 1, 2, 3]
    assert topo.filter_match(b=1, c=1) == [3, 7] and topo.filter_match(a=1, b=1, c=1) == [7]
    assert topo.get_coord(6) == topo.ProcessCoord(1, 1, 0) and topo.get_coord(6).a == 1
    pmd = PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=2)
    assert [pmd.get_rank_repr(r) for r in (0, 5)] == ["model_00", "model_01"]
    assert pmd.get_rank_repr(6, omit_axes=[], inner_sep="+") == "pipe+01-data+01-model+00"
    with pytest.raises(ValueError, match="rank 8 not found"):
        topo.get_coord(8)


def test_topology_errors():
    with pytest.raises(ValueError, match="differ in length"):
        ProcessTopology(("pipe", "data"), (2,))
    with pytest.raises(ValueError, match="not divisible"):
        ProcessTopology.for_world(6, pipe=2, model=2)


def test_layers_without_a_grid_are_plain_layers():
    from shardwise.tensor_parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
    from shardwise.topology import _forget_grids

    _forget_grids()  # no active grid (an earlier in-process test may have left one)
    from shardwise.topology import ONE_RANK, active_grid, tensor_parallel_group_and_size

    assert active_grid() is None and tensor_parallel_group_and_size() == (ONE_RANK, 1)  # no grid: no tensor axis
    torch.manual_seed(0)
    ref = nn.Linear(6, 4)
    torch.manual_seed(0)
    col = ColumnParallelLinear(6, 4)
    torch.manual_seed(0)
    row = RowParallelLinear(6, 4)
    assert torch.equal(col.weight, ref.weight) and torch.equal(row.bias, ref.bias)
    assert col.weight.tensor_model_parallel and col.weight.partition_dim == 0 and row.weight.partition_dim == 1
    assert not hasattr(row.bias, "tensor_model_parallel")
    torch.manual_seed(1)
    emb = nn.Embedding(10, 3)
    torch.manual_seed(1)
    assert torch.equal(VocabParallelEmbedding(10, 3).weight, emb.weight)


# -- layers at tensor size 2 and 4 ------------------------------------------------------------------
def _check_layers(tp, rank, world):
    from shardwise.topology import ParallelGrid

    from shardwise import comm
    from shardwise.tensor_parallel import ColumnParallelLinear, reduce_from_tensor_model_parallel_region

    grid = ParallelGrid(PipeModelDataParallelTopology(num_pp=1, num_mp=tp, num_dp=world // tp))
    x = torch.randn(3, 5, 8, dtype=torch.float64)
    ones = torch.ones(2, dtype=torch.float64)
    with grid.active():  # layers and regions without group= use the active grid's tensor axis
        result = _check_layers_on(grid, tp)
        col = ColumnParallelLinear(8, 12, dtype=torch.float64)
        inside = col(x)
        assert reduce_from_tensor_model_parallel_region(ones).tolist() == [tp, tp]
        # group=None is the whole world, as in comm and zero, not the tensor axis
        assert reduce_from_tensor_model_parallel_region(ones, None).tolist() == [world, world]
    # A layer keeps the tensor group it was built with (at tp == world too, where that group is None).
    assert torch.equal(col(x), inside)
    # Size-1 axes get a group of this rank alone, never None (which would mean the world).
    for g in (grid.get_pipe_parallel_group(), grid.get_sequence_parallel_group()):
        assert g is not None and comm.get_world_size(g) == 1
    return result


def _check_layers_on(grid, tp):
    from shardwise.tensor_parallel import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                                           gather_from_sequence_parallel_region,
                                           reduce_scatter_to_sequence_parallel_region,
                                           scatter_to_sequence_parallel_region, vocab_parallel_cross_entropy)

    r = grid.get_tensor_model_parallel_rank()
    assert grid.get_tensor_model_parallel_world_size() == tp
    torch.manual_seed(3)
    x = torch.randn(3, 5, 8, dtype=torch.float64)
    go = torch.randn(3, 5, 12, dtype=torch.float64)
    tol = dict(rtol=1e-12, atol=1e-12)

    def run_ref(layer, inp, gout):
        inp = inp.clone().requires_grad_(True)
        out = layer(inp)
        out.backward(gout)
        return out, inp.grad

    for gather in (True, False):  # ColumnParallelLinear, then its output slice
        torch.manual_seed(7)
        ref = nn.Linear(8, 12).double()
        torch.manual_seed(7)
        col = ColumnParallelLinear(8, 12, gather_output=gather, dtype=torch.float64)
        out_ref, gx_ref = run_ref(ref, x, go)
        xi = x.clone().requires_grad_(True)
        out = col(xi)
        g = go if gather else go.chunk(tp, -1)[r]
        out.backward(g)
        torch.testing.assert_close(out, out_ref if gather else out_ref.chunk(tp, -1)[r], **tol)
        torch.testing.assert_close(xi.grad, gx_ref, **tol)
        torch.testing.assert_close(col.weight.grad, ref.weight.grad.chunk(tp, 0)[r], **tol)
        torch.testing.assert_close(col.bias.grad, ref.bias.grad.chunk(tp, 0)[r], **tol)

    go2 = go[..., :6]
    for parallel_in in (False, True):
        torch.manual_seed(8)
        ref = nn.Linear(8, 6).double()
        torch.manual_seed(8)
        row = RowParallelLinear(8, 6, input_is_parallel=parallel_in, dtype=torch.float64)
        out_ref, gx_ref = run_ref(ref, x, go2)
        xi = (x.chunk(tp, -1)[r] if parallel_in else x).clone().requires_grad_(True)
        out = row(xi)
        out.backward(go2)
        torch.testing.assert_close(out, out_ref, **tol)
        torch.testing.assert_close(xi.grad, gx_ref.chunk(tp, -1)[r] if parallel_in else gx_ref, **tol)
        torch.testing.assert_close(row.weight.grad, ref.weight.grad.chunk(tp, 1)[r], **tol)
        torch.testing.assert_close(row.bias.grad, ref.bias.grad, **tol)

    # VocabParallelEmbedding: ids from every rank's range, gradient rows land on the owner.
    torch.manual_seed(9)
    ref = nn.Embedding(16, 4).double()
    torch.manual_seed(9)
    emb = VocabParallelEmbedding(16, 4, dtype=torch.float64)
    ids = torch.randint(0, 16, (3, 5))
    ge = torch.randn(3, 5, 4, dtype=torch.float64)
    ref(ids).backward(ge)
    out = emb(ids)
    out.backward(ge)
    torch.testing.assert_close(out, ref(ids), **tol)
    torch.testing.assert_close(emb.weight.grad, ref.weight.grad.chunk(tp, 0)[r], **tol)

    # Vocab-parallel cross-entropy (with an ignored token) against F.cross_entropy on full logits.
    logits = torch.randn(3, 5, 16, dtype=torch.float64)
    target = torch.randint(0, 16, (3, 5))
    target[0, 0] = -100
    full = logits.clone().requires_grad_(True)
    loss_ref = F.cross_entropy(full.view(-1, 16), target.view(-1), reduction="none").view(3, 5)
    gl = torch.rand(3, 5, dtype=torch.float64)
    loss_ref.backward(gl)
    mine = logits.chunk(tp, -1)[r].clone().requires_grad_(True)
    loss = vocab_parallel_cross_entropy(mine, target)
    loss.backward(gl)
    torch.testing.assert_close(loss.double(), loss_ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(mine.grad.double(), full.grad.chunk(tp, -1)[r], rtol=1e-6, atol=1e-6)

    # Sequence-parallel mappings: scatter/gather round trip and reduce-scatter = sum then slice.
    y = torch.randn(3, 4 * tp, 8, dtype=torch.float64) * (r + 1)
    yi = y.clone().requires_grad_(True)
    red = reduce_scatter_to_sequence_parallel_region(yi, dim=1)
    total = sum(y / (r + 1) * (k + 1) for k in range(tp))
    torch.testing.assert_close(red, total.chunk(tp, 1)[r], **tol)
    back = gather_from_sequence_parallel_region(red, dim=1, tensor_parallel_output_grad=False)
    torch.testing.assert_close(back, total, **tol)
    ys = y.clone().requires_grad_(True)
    shard = scatter_to_sequence_parallel_region(ys, dim=1)
    torch.testing.assert_close(shard, y.chunk(tp, 1)[r], **tol)
    shard.backward(torch.ones_like(shard))
    torch.testing.assert_close(ys.grad, torch.ones_like(y))  # backward all-gathers every rank's slice
    return tp


def test_checkpoint_layout_of_strided_and_plain_pieces():
    """Pieces saved at one (tensor size, partition_stride, partition_dim) read back at any other."""
    from shardwise.checkpoint.tensor_parallel import (TensorParallelView, assemble, piece_of, piece_runs,
                                                      read_local, to_canonical)

    class Reader:  # the saved layout, as the fragments of every rank describe it
        def __init__(self, flat):
            self.flat = flat

        def read_range(self, entry, start, end, *, what):
            return self.flat[start:end]

    full = torch.arange(12 * 6, dtype=torch.float32).view(12, 6)
    for dim in (0, 1):
        saved = torch.full((full.numel(),), float("nan"))
        pieces = [piece_of(full, dim, 3 if dim == 0 else 1, 2, r) for r in range(2)]  # fused-qkv-like at tp 2
        torch.testing.assert_close(assemble(pieces, dim, 3 if dim == 0 else 1), full)
        for r, piece in enumerate(pieces):
            for start, end, data in piece_runs(piece, dim, 3 if dim == 0 else 1, 2, r):
                saved[start:end] = data
        torch.testing.assert_close(saved, to_canonical(full, dim))  # the runs tile the layout exactly
        entry = {"shape": [12, 6], "partition_dim": dim}
        for size, stride in ((1, 1), (3, 1), (2, 3) if dim == 0 else (2, 1)):
            for r in range(size):
                tp = TensorParallelView(size=size, rank=r, partition_dims={"w": dim} if size > 1 else {},
                                        strides={"w": stride} if stride > 1 else {})
                want = piece_of(full, dim, stride, size, r)
                got = read_local(Reader(saved), entry, "w", list(want.shape), 3, want.numel() - 1, tp, what="w")
                torch.testing.assert_close(got, want.reshape(-1)[3:-1], msg=f"dim {dim} size {size} stride {stride}")


def test_rng_tracker_streams_and_recompute():
    from shardwise import checkpointing
    from shardwise.checkpointing import get_cuda_rng_tracker, model_parallel_cuda_manual_seed

    def draws(tp_rank):
        model_parallel_cuda_manual_seed(11, tp_rank=tp_rank)
        with get_cuda_rng_tracker().fork():
            inside = torch.rand(4)
        return inside, torch.rand(4)  # the default stream: seeded with 11 on every tensor rank

    (in0, out0), (in1, out1) = draws(0), draws(1)
    assert not torch.equal(in0, in1) and torch.equal(out0, out1)
    assert torch.equal(out0, torch.manual_seed(11) and torch.rand(4))

    # activation checkpointing recomputes a tracker-stream dropout with the forward pass's mask
    model_parallel_cuda_manual_seed(3, tp_rank=0)
    x = torch.randn(64, requires_grad=True)

    def block(t):
        with get_cuda_rng_tracker().fork():
            return torch.nn.functional.dropout(t, 0.5, True) * 2

    y = checkpointing.checkpoint(block, x)
    y.sum().backward()
    kept = y.detach() != 0
    torch.testing.assert_close(x.grad, kept.float() * 4)  # gradient mask = forward mask
    get_cuda_rng_tracker().reset()


# -- 3D parity and checkpoints across grids -------------------------------------------------------
CFG = GPTConfig(vocab_size=32, seq_len=8, hidden=16, n_layers=2, n_heads=2)
STEPS, MICRO, ROWS = 3, 2, 8  # optimizer steps, micro-batches per step, sequences per step
CLIP, LR = 0.5, 0.5  # the gradient norm is ~0.6 at step 0: clipping acts


def data(step: int):
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, CFG.vocab_size, (ROWS, CFG.seq_len + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def reference(steps: int):
    model = GPT(CFG)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    losses = []
    for step in range(steps):
        x, y = data(step)
        opt.zero_grad()
        loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        losses.append(float(loss.detach()))
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _config(dp: int, zero: int) -> dict:
    return {"train_batch_size": ROWS, "gradient_accumulation_steps": MICRO,
            "train_micro_batch_size_per_gpu": ROWS // MICRO // dp, "gradient_clipping": CLIP,
            # SGD, not Adam: Adam's update is blind to a uniform gradient scale, so a wrong clip would not show
            "optimizer": {"type": "SGD", "params": {"lr": LR, "momentum": 0.9}},
            "zero_optimization": {"stage": zero, "reduce_bucket_size": 200}}


def _engine(case: dict):
    import shardwise
    from shardwise.models.gpt import gpt_pipeline_module
    from shardwise.topology import ParallelGrid, PipeModelDataParallelTopology

    from shardwise.parallel_dims import ParallelDims

    dp, pp, tp, sp = case["dp"], case["pp"], case["tp"], case.get("sp", 1)
    topo = PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=dp) if sp == 1 else \
        ProcessTopology.from_dims(ParallelDims(data=dp, pipe=pp, tensor=tp, sequence=sp))
    cfg = {**_config(dp, case.get("zero", 0)), **case.get("config", {})}
    if pp > 1:
        model = gpt_pipeline_module(CFG, topology=topo, partition_method="uniform")
        engine, *_ = shardwise.initialize(model=model, config=cfg)
    else:
        grid = ParallelGrid(topo)
        with grid.active():  # the model's tensor-parallel layers cut themselves over this grid
            with shardwise.zero.Init(mpu=grid, enabled=case.get("zero_init", False)):  # pieces cut over the data axis
                model = GPT(CFG)
        engine, *_ = shardwise.initialize(model=model, mpu=grid, config=cfg)
    return engine


def _run(engine, first: int, count: int, evals=None) -> list[float]:
    grid = engine.grid
    dp, d = grid.get_data_parallel_world_size(), grid.get_data_parallel_rank()
    sp, s = grid.get_sequence_parallel_world_size(), grid.get_sequence_parallel_rank()
    per, cut = ROWS // dp // MICRO, CFG.seq_len // sp  # Ulysses: this sequence rank's slice of every row
    losses = []
    for step in range(first, first + count):
        x, y = (t[:, s * cut:(s + 1) * cut] for t in data(step))
        mine = [(x[(d * MICRO + m) * per:(d * MICRO + m + 1) * per], y[(d * MICRO + m) * per:(d * MICRO + m + 1) * per])
                for m in range(MICRO)]
        if grid.get_pipe_parallel_world_size() > 1:
            if evals is not None:  # the same weights and micro-batches as the train_batch that follows
                evals.append(float(engine.eval_batch(iter(mine))))
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
    from shardwise.zero import GatheredParameters, is_partitioned

    grid = engine.grid
    out = {}
    for name, p in engine.module.named_parameters():
        with GatheredParameters([p]):  # ZeRO-3: this tensor rank's piece, whole over the data axis
            t = p.detach().clone() if is_partitioned(p) else p.detach()
        if getattr(p, "tensor_model_parallel", False) and grid.get_tensor_model_parallel_world_size() > 1:
            parts = [torch.empty_like(t) for _ in range(grid.get_tensor_model_parallel_world_size())]
            torch.distributed.all_gather(parts, t.contiguous(), group=grid.get_tensor_model_parallel_group())
            t = torch.cat(parts, dim=p.partition_dim)
        out[name] = t.clone()
    keep = grid.get_data_parallel_rank() == 0 and grid.get_tensor_model_parallel_rank() == 0
    return out if keep else {}


def _train(case: dict, ckpt: str):
    engine = _engine(case)
    ckpt = f"{ckpt}/{case['dir']}" if "dir" in case else ckpt
    if case.get("load"):  # saved by another grid after 2 steps: continue with step 3
        engine.load_checkpoint(ckpt, tag="t")
        assert engine.global_steps == 2
        losses = _run(engine, 2, STEPS - 2)
    else:
        evals = [] if case.get("eval") else None
        losses = _run(engine, 0, 2, evals)
        if case.get("save"):
            engine.save_checkpoint(ckpt, tag="t")
        losses += _run(engine, 2, STEPS - 2, evals)
        if evals is not None:  # eval_batch reduces the loss as train_batch does (once per tensor rank)
            assert evals == pytest.approx(losses, rel=1e-6, abs=0), (evals, losses)
    if case.get("save16"):
        engine.save_16bit_model(ckpt + "/16bit")
    from shardwise import checkpointing

    return {"losses": losses, "params": _full_params(engine), "kept": checkpointing.get_profile()["kept_bytes"]}


def _refusals():
    """A model zero.Init partitioned over every rank (no mpu) cannot train at tensor 2 x data 2; Megatron's
    sequence parallelism with partitioned activation checkpoints is refused (it trained wrong)."""
    import dataclasses

    import shardwise
    from shardwise.topology import ParallelGrid, PipeModelDataParallelTopology

    grid = ParallelGrid(PipeModelDataParallelTopology(num_pp=1, num_mp=2, num_dp=2))
    with grid.active(), shardwise.zero.Init():
        model = GPT(CFG)
    with pytest.raises(ValueError, match=r"partitioned by zero.Init over ranks \[0, 1, 2, 3\], but this engine's "
                                         r"ZeRO-3 data axis is ranks \[\d, \d\]"):
        shardwise.initialize(model=model, mpu=grid, config=_config(2, 3))
    with grid.active():
        model = GPT(dataclasses.replace(CFG, sequence_parallel=True))
    with pytest.raises(ValueError, match="partition_activations with Megatron sequence parallelism"):
        shardwise.initialize(model=model, mpu=grid, config={**_config(2, 1), "activation_checkpointing": {
            "partition_activations": True}})


def _body(rank, world, cases, ckpt):
    layers = run_subtests(_check_layers, [2, 4], rank, world) if world == 4 else None  # one spawn for both
    if world == 4:
        _refusals()
    return layers, run_subtests(lambda c: (c["name"], _train(c, ckpt)), cases)


def _check(results, cases):
    ref_losses, ref_params = reference(STEPS)
    if results[0][0] is not None:  # the layer checks at tensor size 2 and 4 ran on every rank
        assert [r[0] for r in results] == [[2, 4]] * len(results)
    results = [r[1] for r in results]
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
        for k in ref_params:
            torch.testing.assert_close(merged[k], ref_params[k], rtol=1e-6, atol=1e-6,
                                       msg=lambda m, k=k: f"{case['name']} {k}: {m}")
    return ref_params


# Saved at (dp 2, pp 2, tp 2) under ZeRO-1; loaded at (dp 2, pp 1, tp 2) ZeRO-2 and (dp 4, pp 1, tp 1)
# ZeRO-0: each continues exactly as one process does.
# ZeRO-3 under tensor parallelism partitions each tensor rank's pieces over the data axis: pipe 2 x tensor 2 x
# data 2, and a checkpoint saved at (dp 2, tp 2, ZeRO-3) continues at (dp 4, ZeRO-1) and in one process.
# Ulysses: pipe 2 x sequence 2, its checkpoint continued at (dp 2, tp 2, ZeRO-3).
CASES_8 = [{"name": "dp2 pp2 tp2", "dp": 2, "pp": 2, "tp": 2, "zero": 1, "save": True},
           {"name": "dp2 pp2 tp2 zero3", "dp": 2, "pp": 2, "tp": 2, "zero": 3}]
CASES_4 = [{"name": "dp2 pp1 tp2", "dp": 2, "pp": 1, "tp": 2, "zero": 2, "save16": True},
           {"name": "resume dp2 pp1 tp2", "dp": 2, "pp": 1, "tp": 2, "zero": 2, "load": True},
           {"name": "resume dp4 tp1", "dp": 4, "pp": 1, "tp": 1, "zero": 0, "load": True},
           {"name": "dp2 tp2 zero3 built in zero.Init", "dp": 2, "pp": 1, "tp": 2, "zero": 3, "zero_init": True,
            "save": True, "dir": "z3"},
           {"name": "pp2 sp2 (Ulysses)", "dp": 1, "pp": 2, "tp": 1, "sp": 2, "zero": 1, "save": True, "dir": "sp"},
           {"name": "resume dp2 tp2 zero3 from pp2 sp2", "dp": 2, "pp": 1, "tp": 2, "zero": 3, "load": True,
            "dir": "sp"},
           {"name": "resume dp4 zero1 from dp2 tp2 zero3", "dp": 4, "pp": 1, "tp": 1, "zero": 1, "load": True,
            "dir": "z3"},
           # last: the activation_checkpointing settings are process-wide and outlive the engine
           {"name": "dp1 pp2 tp2 partitioned activations", "dp": 1, "pp": 2, "tp": 2, "zero": 1, "eval": True,
            "config": {"pipeline": {"activation_checkpoint_interval": 1},
                       "activation_checkpointing": {"partition_activations": True}}}]


CASES_1 = [{"name": "resume one process from dp2 tp2 zero3", "dp": 1, "pp": 1, "tp": 1, "zero": 0, "load": True,
            "dir": "z3"}]


def test_layers_and_3d_parity_and_checkpoint_across_grids(tmp_path):
    from safetensors.torch import load_file

    from shardwise.checkpoint.consolidate import get_fp32_state_dict_from_checkpoint

    ckpt = str(tmp_path)
    _check(run_distributed(_body, 8, args=(CASES_8, ckpt), timeout=300), CASES_8)
    # the checkpoint's weights are the whole tensors of one process after 2 steps
    _, ref2 = reference(2)
    consolidated = get_fp32_state_dict_from_checkpoint(ckpt, tag="t")
    assert consolidated.keys() == ref2.keys()
    for k in ref2:
        torch.testing.assert_close(consolidated[k], ref2[k], rtol=1e-6, atol=1e-6)
    ref_final = _check(run_distributed(_body, 4, args=(CASES_4, ckpt), timeout=300), CASES_4)
    _check(run_distributed(_body, 1, args=(CASES_1, ckpt), timeout=120), CASES_1)
    consolidated = get_fp32_state_dict_from_checkpoint(f"{ckpt}/z3", tag="t")  # tensor pieces of ZeRO-3 shards
    assert consolidated.keys() == ref2.keys()
    for k in ref2:
        torch.testing.assert_close(consolidated[k], ref2[k], rtol=1e-6, atol=1e-6)
    whole = load_file(str(tmp_path / "16bit" / "model.safetensors"))  # save_16bit_model: unsharded
    assert whole.keys() == ref_final.keys()
    for k in ref_final:
        torch.testing.assert_close(whole[k], ref_final[k], rtol=1e-6, atol=1e-6)
