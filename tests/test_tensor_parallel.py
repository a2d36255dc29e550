"""Tensor-parallel layers, mappings and vocab-parallel cross-entropy equal their one-process torch
counterparts (forward and backward) at tensor size 2 and 4; topology arithmetic without processes."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from distributed import run_distributed, run_subtests
from shardwise.topology import PipeModelDataParallelTopology, ProcessTopology


# -- topology arithmetic (no processes) ---------------------------------------------------------
def test_pipe_model_data_layout_matches_deepspeed():
    topo = PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=2)
    assert topo.axes == ("pipe", "data", "model") and topo.dims == (2, 2, 2)
    # DeepSpeed's layout: model fastest, then data, then pipe.
    assert topo.get_coord(5) == {"pipe": 1, "data": 0, "model": 1}
    assert topo.get_rank(pipe=1, data=1, model=0) == 6
    assert topo.axis_groups("model") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert topo.axis_groups("data") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert topo.axis_groups("pipe") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert topo.get_axis_comm_lists("expert") == []
    for r in range(8):
        assert topo.get_rank(**topo.get_coord(r)) == r


def test_topology_errors():
    with pytest.raises(ValueError, match="differ in length"):
        ProcessTopology(("pipe", "data"), (2,))
    with pytest.raises(ValueError, match="not divisible"):
        ProcessTopology.for_world(6, pipe=2, model=2)


def test_layers_without_a_grid_are_plain_layers():
    from shardwise.tensor_parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
    from shardwise.topology import _set_current_grid

    _set_current_grid(None)
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
    from shardwise.tensor_parallel import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                                           gather_from_sequence_parallel_region,
                                           reduce_scatter_to_sequence_parallel_region,
                                           scatter_to_sequence_parallel_region, vocab_parallel_cross_entropy)
    from shardwise.topology import ParallelGrid

    grid = ParallelGrid(PipeModelDataParallelTopology(num_pp=1, num_mp=tp, num_dp=world // tp))
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


def _layers_body(rank, world):
    return run_subtests(_check_layers, [2, 4], rank, world)


def test_layers_and_cross_entropy_match_torch_at_tp2_and_tp4():
    assert run_distributed(_layers_body, 4, timeout=120) == [[2, 4]] * 4


def test_rng_tracker_streams_and_recompute():
    from shardwise import checkpointing
    from shardwise.runtime.activation_checkpointing.checkpointing import (get_cuda_rng_tracker,
                                                                          model_parallel_cuda_manual_seed)

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
