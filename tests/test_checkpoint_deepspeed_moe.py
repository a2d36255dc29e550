"""Importing DeepSpeed's MoE checkpoints (docs/checkpoints.md "From DeepSpeed", docs/moe.md "Checkpoints").

tests/fixtures/deepspeed/moe_zero{0,2} (2 ranks) and moe_zero2_dp4 (4 ranks) were written by DeepSpeed 0.19.8
itself (make_fixtures.py ``run_moe``): ``MoENet`` with DeepSpeed's ``MoE`` (4 experts, ``ep_size`` 2), trained
3 steps, saved (``layer_0_expert_<e>_...`` files, ``expp_rank_<r>_...`` optimizer files at ZeRO-0, ZeRO-2's
partitions with the expert groups over the expert-data-parallel group), then 4 more steps whose mean
losses and learning rates are recorded. Loaded into shardwise at ep 2 over 2 ranks and at ep 1 in one
process (each shardwise rank taking DeepSpeed's ranks' micro-batches by gradient accumulation), the
continuation must give DeepSpeed's losses: the first one is the loss of the imported weights, the later
ones follow from the imported Adam moments and step counts.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from distributed import run_distributed, run_subtests
from shardwise.checkpoint.deepspeed_import import convert_deepspeed_checkpoint

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "deepspeed"
_spec = importlib.util.spec_from_file_location("deepspeed_fixture_model", FIXTURES / "model.py")
ds_model = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ds_model)

LOSS_RTOL, LR_RTOL = 1e-6, 1e-12  # fp32 both sides (observed: equal to float rounding)


def _continue(case, rank, world):
    """Load ``fixture`` into shardwise at ``ep`` / ZeRO ``stage`` over ``world`` ranks and train 4 steps."""
    import shardwise
    from shardwise.moe.layer import MoE
    from shardwise.moe.utils import split_params_into_different_moe_groups_for_optimizer as split

    fixture, ep, stage, client_optimizer = case
    record = json.loads((FIXTURES / fixture / "continuation.json").read_text())
    ds_world = record["world_size"]
    accum = ds_world // world  # shardwise rank r takes DeepSpeed rank (i * world + r)'s batch in micro-step i
    model = ds_model.MoENet(MoE, ep_size=ep, ep_rank=rank % ep)
    cfg = ds_model.moe_ds_config(stage)
    cfg["gradient_accumulation_steps"] = accum
    if client_optimizer:  # DeepSpeed's param groups: dense, then ep_size_<N>
        engine, *_ = shardwise.initialize(model=model, optimizer=ds_model.moe_optimizer(model, split), config=cfg)
    else:  # one param group from the config: DeepSpeed's two (same settings) are applied to it
        cfg["optimizer"] = ds_model.ds_config(stage)["optimizer"]
        engine, *_ = shardwise.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    path, client = engine.load_checkpoint(str(FIXTURES / fixture))
    assert Path(path) == FIXTURES / fixture / "global_step3"
    assert client["epoch"] == 2 and torch.equal(client["counts"], torch.arange(3)) and "num_experts" not in client
    assert engine.global_steps == 3 and engine.get_lr()[0] == pytest.approx(record["before"][-1]["lr"], rel=LR_RTOL)
    got = []
    for entry in record["continuation"]:
        total = torch.zeros(())
        for i in range(accum):
            loss = engine(*ds_model.batch(entry["step"], i * world + rank))
            engine.backward(loss)
            engine.step()
            total += loss.detach()
        if world > 1:
            dist.all_reduce(total)
        got.append((total.item() / ds_world, engine.get_lr()[0]))
    for (loss, lr), e in zip(got, record["continuation"]):
        assert loss == pytest.approx(e["loss"], rel=LOSS_RTOL), f"{case} step {e['step']}: {loss} vs {e['loss']}"
        assert lr == pytest.approx(e["lr"], rel=LR_RTOL), f"{case} step {e['step']}: lr {lr} vs DeepSpeed's {e['lr']}"
    return [loss for loss, _ in got]


def _two_ranks(rank, world):
    # the saved layout (ep 2, ZeRO-0 and ZeRO-2), the 4-rank ZeRO-2 one (experts partitioned over 2 ranks) at
    # ep 2 / ZeRO-1, and ep 1 (every expert on both ranks) at ZeRO-3 from ZeRO-2's
    return run_subtests(_continue, [("moe_zero2", 2, 2, True), ("moe_zero0", 2, 0, True),
                                    ("moe_zero2_dp4", 2, 1, True), ("moe_zero2", 1, 3, True)], rank, world)


def _one_rank(rank, world):
    return run_subtests(_continue, [("moe_zero2", 1, 0, True), ("moe_zero0", 1, 2, False),
                                    ("moe_zero2_dp4", 1, 2, True)], rank, world)


def test_deepspeed_moe_checkpoints_continue_at_ep2_over_two_ranks():
    run_distributed(_two_ranks, 2, timeout=240)


def test_deepspeed_moe_checkpoints_continue_in_one_process():
    run_distributed(_one_rank, 1, timeout=120)


@pytest.mark.parametrize("fixture, remove, message", [
    ("moe_zero2", "layer_0_expert_2_mp_rank_00_model_states.pt",
     r"MoE layer 0 has 4 experts .* the files of experts \[2\] \(layer_0_expert_<e>_mp_rank_00_model_states.pt\) "
     r"are missing"),
    ("moe_zero0", "expp_rank_0_mp_rank_00_optim_states.pt",
     r"the optimizer files of expert-parallel ranks \[0\] \(expp_rank_<r>_mp_rank_00_optim_states.pt\) are missing"),
    ("moe_zero2", "zero_pp_rank_1_mp_rank_00_optim_states.pt", r"rank 1's optimizer file zero_pp_rank_1_mp_rank_00"),
])
def test_missing_moe_files_are_named(fixture, remove, message, tmp_path):
    shutil.copytree(FIXTURES / fixture, tmp_path / "ds")
    (tmp_path / "ds" / "global_step3" / remove).unlink()
    with pytest.raises((FileNotFoundError, ValueError), match=message):
        convert_deepspeed_checkpoint(tmp_path / "ds", tmp_path / "native")


@pytest.mark.parametrize("field, value, message", [
    ("ds_autoep_layers", [{"layer": 0}], r"a DeepSpeed AutoEP checkpoint \(field 'ds_autoep_layers'\)"),
    ("ds_config", {"use_data_before_expert_parallel_": True}, r"use_data_before_expert_parallel_=true"),
])
def test_unsupported_moe_layouts_are_named(field, value, message, tmp_path):
    shutil.copytree(FIXTURES / "moe_zero2", tmp_path / "ds")
    path = tmp_path / "ds" / "global_step3" / "mp_rank_00_model_states.pt"
    states = torch.load(path, weights_only=False)
    states[field] = value
    torch.save(states, path)
    with pytest.raises(ValueError, match=message):
        convert_deepspeed_checkpoint(tmp_path / "ds", tmp_path / "native")
