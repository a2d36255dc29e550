"""runtime/train_step.py: over which ranks the gradient norm is summed, and which parameters count."""

from __future__ import annotations

import torch


from shardwise.runtime.train_step import norm_scope
from shardwise.zero.layout import ParamLayout


class _Grid:
    """The grid accessors norm_scope reads, for one rank of a pipe x tensor x data layout."""

    def __init__(self, *, pipe=1, tensor=1, data=1, tensor_rank=0, data_rank=0, model_group="mp-group"):
        self.pipe, self.tensor, self.data = pipe, tensor, data
        self.tensor_rank, self.data_rank, self.model_group = tensor_rank, data_rank, model_group

    def get_pipe_parallel_world_size(self):
        return self.pipe

    def get_tensor_model_parallel_world_size(self):
        return self.tensor

    def get_tensor_model_parallel_rank(self):
        return self.tensor_rank

    def get_data_parallel_world_size(self):
        return self.data

    def get_data_parallel_rank(self):
        return self.data_rank

    def get_model_parallel_group(self):
        return self.model_group


class _Strategy:
    layout = ParamLayout()  # (the strategies' reduce domains: no experts)

    def __init__(self, norm_is_local):
        self.norm_is_local = norm_is_local
        self.dp_group = "dp-group"


def _module():
    m = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    m[0].weight.tensor_model_parallel = True  # a tensor-sharded weight; the rest is replicated
    return m


def test_data_parallel_only():
    partitioned = norm_scope(_Strategy(False), grid=_Grid(data=2), module=_module())
    assert (partitioned.group, partitioned.reduce, partitioned.counted) == ("dp-group", True, None)
    replicated = norm_scope(_Strategy(True), grid=_Grid(data=2), module=_module())
    assert replicated.reduce is False and replicated.counted is None


def test_grid_counts_each_element_once():
    skip = {"1.bias"}  # a tied duplicate another stage owns
    for tensor_rank, counted in ((0, {"0.weight", "0.bias", "1.weight"}), (1, {"0.weight"})):
        grid = _Grid(pipe=2, tensor=2, data=2, tensor_rank=tensor_rank)
        names = [n for n, _ in _module().named_parameters()]
        partitioned = norm_scope(_Strategy(False), grid=grid, module=_module(), skip=skip)
        assert partitioned.group is None and partitioned.reduce and partitioned.contributes  # the whole world
        assert {n for n in names if partitioned.counted(n)} == counted
        replicated = norm_scope(_Strategy(True), grid=grid, module=_module(), skip=skip)
        assert replicated.group == "mp-group" and replicated.reduce  # every data rank holds the same sum
        assert {n for n in names if replicated.counted(n)} == counted
    # a user's mpu without a model-parallel group: the world, data rank 0 alone contributing
    fallback = norm_scope(_Strategy(True), grid=_Grid(tensor=2, data=2, data_rank=1, model_group=None),
                          module=_module())
    assert fallback.group is None and not fallback.contributes
