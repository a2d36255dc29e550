"""DeepSpeed's AutoTP layer classes of the compat package (``deepspeed.module_inject.layers``) on two real ranks:
forward and gradients equal the unsharded layers, the universal-checkpoint metadata each parameter carries
restores exactly the piece the rank holds, ``gather_params`` / ``_tp_partition`` round-trip, and a split
shardwise's checkpoints cannot describe is refused. The compat package is imported inside the spawned ranks
only (it installs an import hook for ``deepspeed``)."""
from __future__ import annotations

import copy
from pathlib import Path

import torch

from distributed import run_distributed

COMPAT = str(Path(__file__).resolve().parents[1] / "compat" / "deepspeed")


def _body(rank, world, compat):
    import sys

    import pytest
    sys.path.insert(0, compat)
    from deepspeed.checkpoint.constants import (PARAMETER_WITH_ROW_PARALLELISM_PATTERNS, PARAMETER_WITH_SUB_PARAMS,
                                                TP_REPLICATED_PARAMETER_PATTERNS)
    from deepspeed.checkpoint.universal_checkpoint import _resolve_autotp_partition
    from deepspeed.module_inject.layers import (GateUpPack_LinearLayer, LinearAllreduce, LinearLayer,
                                                SubParamLinearLayer, collect_autotp_universal_checkpoint_info,
                                                set_autotp_mode)

    set_autotp_mode(training=True)
    group = torch.distributed.new_group([0, 1])
    torch.manual_seed(0)
    col, row, qkv, gate_up = (torch.nn.Linear(8, 12), torch.nn.Linear(12, 8), torch.nn.Linear(8, 12),
                              torch.nn.Linear(8, 12, bias=False))
    x = torch.randn(3, 8)

    model = torch.nn.Module()
    model.col = LinearLayer(copy.deepcopy(col), group, name="col")
    model.row = LinearAllreduce(copy.deepcopy(row), group, name="row")
    model.qkv = SubParamLinearLayer(copy.deepcopy(qkv), group, shape=(3, -1), partition_dim=0, name="qkv")
    model.gate_up = GateUpPack_LinearLayer(copy.deepcopy(gate_up), group, name="dense_h_to_4h")

    # forward and gradients: the unsharded layers' (row-parallel output all-reduced, bias added once)
    out = model.row(model.col(x))
    want = row(col(x))
    torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-7)
    out.square().sum().backward()
    want.square().sum().backward()
    torch.testing.assert_close(model.col.weight.grad, col.weight.grad.chunk(2, 0)[rank], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(model.row.weight.grad, row.weight.grad.chunk(2, 1)[rank], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(model.row.bias.grad, row.bias.grad, rtol=1e-6, atol=1e-7)

    # sub-parameters: each rank holds its slice of every block (Megatron's strided layout, stride = blocks)
    pieces = {"qkv": torch.cat([b.chunk(2, 0)[rank] for b in qkv.weight.detach().chunk(3, 0)]),
              "gate_up": torch.cat([b.chunk(2, 0)[rank] for b in gate_up.weight.detach().chunk(2, 0)])}
    assert torch.equal(model.qkv.weight.detach(), pieces["qkv"]) and model.qkv.weight.partition_stride == 3
    assert torch.equal(model.gate_up.weight.detach(), pieces["gate_up"]) and model.gate_up.weight.partition_stride == 2
    torch.testing.assert_close(model.qkv(x), torch.nn.functional.linear(x, pieces["qkv"], torch.cat(
        [b.chunk(2, 0)[rank] for b in qkv.bias.detach().chunk(3, 0)])), rtol=1e-6, atol=1e-7)

    # the metadata restores exactly the piece the rank holds, from the whole tensor
    for name, full in (("col", col.weight), ("row", row.weight), ("qkv", qkv.weight), ("gate_up", gate_up.weight)):
        param = getattr(model, name).weight
        got = _resolve_autotp_partition(param, {}, full.detach().flatten(), rank, 2)
        assert torch.equal(got, param.detach().flatten()), name
        piece = param.detach().clone()
        param.gather_params([param])
        assert torch.equal(param.detach(), full.detach()), name
        param._tp_partition([param])
        assert torch.equal(param.detach(), piece), name

    info = collect_autotp_universal_checkpoint_info(model)
    assert info[PARAMETER_WITH_ROW_PARALLELISM_PATTERNS] == [r"^row\.weight$"]
    assert r"^row\.bias$" in info[TP_REPLICATED_PARAMETER_PATTERNS]
    assert [e["patterns"] for e in info[PARAMETER_WITH_SUB_PARAMS]] == [[r"^qkv\.weight$"], [r"^qkv\.bias$"],
                                                                        [r"^gate_up\.weight$"]]

    # splits shardwise's tensor-parallel checkpoints cannot describe are refused, naming the layer
    with pytest.raises(ValueError, match="'odd': its split .5, 4. is uneven"):
        LinearLayer(torch.nn.Linear(8, 9), group, name="odd")
    with pytest.raises(ValueError, match="'gqa': sub-parameters \\[8, 4, 4\\]"):
        SubParamLinearLayer(torch.nn.Linear(8, 16), group, shape=((8, 4, 4), -1), partition_dim=0, name="gqa")
    return True


def test_deepspeed_autotp_layers_on_two_ranks():
    assert run_distributed(_body, 2, args=(COMPAT, ), timeout=120) == [True, True]
