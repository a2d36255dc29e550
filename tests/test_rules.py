"""Every refused combination is a row of ``RULES`` (``shardwise/parallel_dims.py``): sites that learn the facts
late (the optimizer object, the model's parameters) ask the table by name (``check_rule``) and raise its
message; "ep_size divides the data axis" is one function (``shardwise.parallel_dims.expert_divides``)."""

from __future__ import annotations

import pytest
import torch

from shardwise.parallel_dims import check_expert_size, expert_divides
from shardwise.parallel_dims import RULES, ParallelDims, check_rule

# (rule name, facts it refuses, facts it lets through, words of its message)
LATE = [
    ("muon_offload", dict(zero_stage=1, muon=True, offload_optimizer=True), dict(zero_stage=1, muon=True),
     "optimizer.type=Muon with zero_optimization.offload_optimizer: not supported. not implemented yet"),
    ("muon_experts", dict(data=2, expert=2, muon=True, moe=True), dict(data=2, muon=True, moe=True),
     "optimizer.type=Muon with expert parallelism (ep_size 2, tensor 1): not supported"),
    ("experts_tensor", dict(data=2, tensor=2, expert=2, moe=True, experts_unsplit_by_tensor=True),
     dict(data=2, tensor=2, expert=2, moe=True), "Block with ep_size 2 and tensor parallelism (tensor 2)"),
    ("partition_activations_sequence_parallel", dict(tensor=2, partition_activations=True,
                                                     sequence_parallel_params=True),
     dict(tensor=2, partition_activations=True), "partition_activations with Megatron sequence parallelism"),
    ("curriculum_model_parallel", dict(data=2, pipe=2, curriculum_sampling=True),
     dict(data=4, curriculum_sampling=True),
     "curriculum data sampling with model, pipeline or sequence parallelism (data-parallel size 2 of 4 ranks)"),
]


@pytest.mark.parametrize("name,refused,allowed,words", LATE, ids=[c[0] for c in LATE])
def test_late_sites_raise_the_tables_message(name, refused, allowed, words):
    dims = ParallelDims(**refused)
    with pytest.raises(ValueError) as late:
        check_rule(name, dims, block="Block")
    assert words in str(late.value)
    with pytest.raises(ValueError) as early:  # validate() finds the same row
        dims.validate()
    rule = next(r for r in RULES if r.name == name)
    assert str(early.value) == rule.message(dims, block="a MoE block")
    check_rule(name, ParallelDims(**allowed), block="Block")
    ParallelDims(**allowed).validate()


def test_rule_names_are_unique_and_known():
    names = [r.name for r in RULES if r.name]
    assert len(names) == len(set(names)) and {c[0] for c in LATE} <= set(names)
    with pytest.raises(KeyError, match="no refusal named 'nope'"):
        check_rule("nope", ParallelDims())


@pytest.mark.parametrize("ep,data,sequence,ok", [(2, 4, 1, True), (4, 2, 2, True), (3, 4, 1, False), (4, 2, 1, False),
                                                 (1, 3, 1, True)])
def test_ep_divides_data_is_one_function(ep, data, sequence, ok):
    assert expert_divides(ep, data * sequence) is ok
    # the table's row uses it
    refused = any("expert size not dividing" in r.table and r.applies(ParallelDims(data=data, sequence=sequence,
                                                                                 expert=ep)) for r in RULES)
    assert refused is not ok
    if ok:
        check_expert_size(ep, data * sequence, key="k")
    else:
        with pytest.raises(ValueError, match=rf"k={ep} does not divide the data-parallel size {data * sequence}"):
            check_expert_size(ep, data * sequence, key="k")


def test_muon_with_optimizer_offload_is_refused_by_the_table():
    """The engine's site (one process): the optimizer is known only when it is built."""
    import shardwise

    config = {"train_batch_size": 1, "optimizer": {"type": "Muon", "params": {"lr": 0.01}},
              "zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}}}
    rule = next(r for r in RULES if r.name == "muon_offload")
    with pytest.raises(ValueError) as err:
        shardwise.initialize(model=torch.nn.Linear(4, 4), config=config)
    assert str(err.value) == rule.message(ParallelDims(zero_stage=1, muon=True, offload_optimizer=True))
