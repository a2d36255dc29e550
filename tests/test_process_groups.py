"""The one builder of process groups: every group comes from ``shardwise.topology`` (the grid) or
``shardwise.comm``, and the grid hands each out by name from one rank layout."""
from __future__ import annotations

import ast
from pathlib import Path

from distributed import run_distributed

REPO = Path(__file__).resolve().parents[1]
CREATORS = {"new_group", "new_subgroups", "new_subgroups_by_enumeration", "init_device_mesh", "DeviceMesh",
            "split_group"}
# Where a group may be created: the grid, and comm (torch.distributed's wrapper the grid calls).
BUILDERS = ("shardwise/topology.py", "shardwise/comm/")
# Not a creation: planning/plan.py counts the grid's new_group calls by wrapping torch's function.
COUNTING_WRAPPER = "shardwise/planning/plan.py"


def _creations(path: Path) -> list[tuple[int, str]]:
    """(line, name) of every call of a group-creating function in ``path`` (``x.new_group(...)``,
    ``new_group(...)``), and of every other mention of one (a function passed around is a creation too)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        name = None
        if isinstance(node, ast.Attribute):
            name = node.attr
        elif isinstance(node, ast.Name):
            name = node.id
        elif isinstance(node, ast.alias):
            name = node.name.rsplit(".", 1)[-1]
        if name in CREATORS:
            found.append((getattr(node, "lineno", 0), name))
    return found


def test_nothing_outside_the_grid_and_comm_creates_a_group():
    offenders = []
    for root in ("shardwise", "compat"):
        for path in sorted((REPO / root).rglob("*.py")):
            rel = path.relative_to(REPO).as_posix()
            if rel.startswith(BUILDERS) or rel == COUNTING_WRAPPER:
                continue
            offenders += [f"{rel}:{line} {name}" for line, name in _creations(path)]
    assert not offenders, ("process groups are created by shardwise.topology (the grid) only; add a named group "
                           "there instead:\n" + "\n".join(offenders))


def test_the_walk_finds_a_creation():
    """The check above can fail: a module calling new_group is found (by call, attribute or import)."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "m.py"
        p.write_text("import torch.distributed as dist\nfrom torch.distributed import new_subgroups\n"
                     "g = dist.new_group([0])\n")
        assert sorted(name for _, name in _creations(p)) == ["new_group", "new_subgroups"]
        assert _creations(REPO / COUNTING_WRAPPER)  # the allowed wrapper does mention it


def _ranks(group):
    import torch.distributed as dist

    return None if group is None else sorted(dist.get_process_group_ranks(group))


def _named_groups(rank, world):
    from shardwise import comm
    from shardwise.inference.engine import InferenceEngine
    from shardwise.parallel_dims import ParallelDims
    from shardwise.topology import ParallelGrid, active_grid, expert_groups

    out = {}
    made = {"n": 0}
    real = comm.new_group

    def counted(*a, **k):
        made["n"] += 1
        return real(*a, **k)

    # data 4 with expert 2: experts split over consecutive data ranks, their replicas strided
    grid = ParallelGrid.from_dims(ParallelDims(data=4, expert=2))
    out["active"] = active_grid()  # building a grid activates nothing
    out["dims"] = grid.dims
    out["data"] = _ranks(grid.group("data"))
    out["expert"] = (_ranks(grid.group("expert")), grid.size("expert"), grid.axis_rank("expert"))
    out["expert_data"] = (_ranks(grid.group("expert_data")), grid.size("expert_data"), grid.axis_rank("expert_data"))
    comm.new_group = counted  # asked again: the same groups, none created
    try:
        same = grid.expert_groups(2) is grid.expert_groups() and grid.group("expert") is grid.group("expert")
        out["again"] = (same, made["n"])
    finally:
        comm.new_group = real
    # an MoE layer outside any grid takes the world's data axis: the same layout, the same groups
    out["world experts same"] = expert_groups(2).group is grid.group("expert")

    # pipe 2 x data 2: tied layers over both stages, per data coordinate; experts per stage
    pipe = ParallelGrid.from_dims(ParallelDims(pipe=2, data=2))
    group, ranks = pipe.tied_group([1, 0])
    out["tied"] = (_ranks(group), ranks, pipe.tied_group((0, 1))[0] is group)
    # the plan builds the engine's grid once every size is known, in the layout of the grid a route built
    # earlier (a PipelineModule's): the groups that exist are found again, only the expert groups are new
    made["n"] = 0
    comm.new_group = counted
    try:
        planned = ParallelGrid.from_dims(ParallelDims(pipe=2, data=2, expert=2), topology=pipe.topology)
    finally:
        comm.new_group = real
    out["pipe experts"] = (_ranks(planned.group("expert")), _ranks(planned.group("expert_data")),
                           planned.dims.expert, pipe.dims.expert)
    out["pipe reused"] = (planned.group("pipe") is pipe.group("pipe"), planned.group("data") is pipe.group("data"),
                          planned.tied_group([0, 1])[0] is group, made["n"])
    out["pipe model_parallel"] = (_ranks(planned.group("model_parallel")), planned.size("model_parallel"))

    # data 1 x sequence 2 x tensor 2: the sequence-data group ZeRO reduces over
    seq = ParallelGrid.from_dims(ParallelDims(sequence=2, tensor=2))
    out["seq"] = (_ranks(seq.group("sequence")), _ranks(seq.group("model")), _ranks(seq.group("sequence_data")),
                  seq.size("sequence_data"))

    # a Megatron-style mpu contributes its sizes; the plan builds the grid from them and checks the mpu's groups
    # hold the same ranks (here they are the same groups: one group per rank list)
    from shardwise.config import load_config
    from shardwise.runtime.plan import plan_grid

    class Mpu:
        def __init__(self, data_group, tensor_group):
            self.groups = data_group, tensor_group

        def get_data_parallel_world_size(self):
            return 2

        def get_tensor_model_parallel_world_size(self):
            return 2

        def get_data_parallel_group(self):
            return self.groups[0]

        def get_tensor_model_parallel_group(self):
            return self.groups[1]

    laid = ParallelGrid.from_dims(ParallelDims(data=2, tensor=2))
    cfg = load_config({"train_micro_batch_size_per_gpu": 1})
    planned, dims = plan_grid(cfg, mpu=Mpu(laid.group("data"), laid.group("model")))
    out["megatron"] = (dims.data, dims.tensor, planned.group("data") is laid.group("data"))
    try:  # its axes swapped: the engine would reduce over other ranks than the user's code
        plan_grid(cfg, mpu=Mpu(laid.group("model"), laid.group("data")))
        out["megatron swapped"] = None
    except ValueError as e:
        out["megatron swapped"] = str(e)

    # inference tensor groups: the grid's tensor axis
    out["inference tp"] = _ranks(InferenceEngine._tensor_group(2, None, None))

    # ZeRO++'s node axis: a size of the dims, its groups built with the grid's others (nodes of 2 ranks)
    made["n"] = 0
    comm.new_group = counted
    try:
        nodes = ParallelGrid.from_dims(ParallelDims(data=4, node_size=2))
        built = made["n"]
        again = ParallelGrid.from_dims(ParallelDims(data=4, node_size=2))
        asked = (nodes.node_groups() is nodes.node_groups(), nodes.group("node") is again.group("node"),
                 nodes.group("node") is grid.group("expert"))
        out["nodes created"] = (built, made["n"] - built, asked)
    finally:
        comm.new_group = real
    out["nodes"] = (_ranks(nodes.group("node")), _ranks(nodes.group("inter_node")), nodes.size("node"),
                    nodes.size("inter_node"), nodes.axis_rank("node"), nodes.axis_rank("inter_node"),
                    nodes.dims.node_size, hasattr(nodes, "add_node_axis"))
    # tensor peers are neighbours: a node of 2 ranks holds one rank of each data group, so the inter-node group
    # is the data group itself (one group per rank list)
    tp_nodes = ParallelGrid.from_dims(ParallelDims(data=2, tensor=2, node_size=2))
    out["tp nodes"] = (_ranks(tp_nodes.group("node")), tp_nodes.group("inter_node") is tp_nodes.group("data"))
    try:
        grid.group("node")
        out["no node axis"] = None
    except ValueError as e:
        out["no node axis"] = str(e)
    return out


def test_the_grid_hands_out_every_group_by_name():
    results = run_distributed(_named_groups, 4, timeout=120)
    for rank, out in enumerate(results):
        assert out["active"] is None
        assert out["dims"].expert == 2 and out["dims"].data == 4
        assert out["data"] is None  # the whole world
        block = [0, 1] if rank < 2 else [2, 3]
        assert out["expert"] == (block, 2, rank % 2), (rank, out["expert"])
        assert out["expert_data"] == ([rank % 2, rank % 2 + 2], 2, rank // 2), (rank, out["expert_data"])
        assert out["again"] == (True, 0)
        assert out["world experts same"]
        d = rank % 2  # pipe outermost: stage s, data d is rank 2 s + d
        assert out["tied"] == ([d, d + 2], [d, d + 2], True), (rank, out["tied"])
        stage = [0, 1] if rank < 2 else [2, 3]
        assert out["pipe experts"] == (stage, [rank], 2, 1), (rank, out["pipe experts"])
        # every group of the planned grid exists already: the expert groups are the stages' data ranks ([0, 1],
        # [2, 3], the data axis's groups) and single ranks (the size-1 model axis's), so none is created
        assert out["pipe reused"] == (True, True, True, 0), (rank, out["pipe reused"])
        assert out["pipe model_parallel"] == ([d, d + 2], 2)
        # (data, sequence, model): tensor fastest, then sequence
        assert out["seq"][0] == ([rank % 2, rank % 2 + 2]) and out["seq"][1] == ([0, 1] if rank < 2 else [2, 3])
        assert out["seq"][2:] == ([rank % 2, rank % 2 + 2], 2), (rank, out["seq"])
        assert out["inference tp"] == ([0, 1] if rank < 2 else [2, 3])
        assert out["megatron"] == (2, 2, True)
        assert "get_data_parallel_group() holds ranks" in out["megatron swapped"], out["megatron swapped"]
        # nodes [0, 1] and [2, 3], inter-node groups [0, 2] and [1, 3]: the rank lists of the expert grid's expert
        # and expert-data groups, so the same groups (one per rank list); asking again or building the same
        # grid again creates none
        node, place = rank // 2, rank % 2
        assert out["nodes"] == ([2 * node, 2 * node + 1], [place, place + 2], 2, 2, place, node, 2, False), \
            (rank, out["nodes"])
        assert out["nodes created"] == (0, 0, (True, True, True)), out["nodes created"]
        assert out["tp nodes"] == ([rank], True), (rank, out["tp nodes"])
        assert "this grid has no node axis" in out["no node axis"]


def test_expert_axis_is_part_of_the_dims():
    import pytest

    from shardwise.parallel_dims import ParallelDims

    d = ParallelDims(data=4, expert=2)
    assert d.world_size == 4 and d.expert_data == 2  # experts split a data axis: no ranks of their own
    assert ParallelDims(data=2, sequence=2, expert=4).expert_data == 1
    with pytest.raises(ValueError, match="MoE ep_size 3 with 4 data-parallel x 1 sequence-parallel ranks"):
        ParallelDims(data=4, expert=3).validate()


# Who may make a grid the active one (docs/engine.md, "The active grid"): initialize (the engine's grid) and
# the sequence-parallel groups register_with_transformers lays out before there is an engine.
ACTIVATORS = ("shardwise/__init__.py", "shardwise/runtime/sequence_parallel/groups.py")


def test_only_initialize_and_the_sequence_groups_activate_a_grid():
    found = []
    for root in ("shardwise", "compat"):
        for path in sorted((REPO / root).rglob("*.py")):
            rel = path.relative_to(REPO).as_posix()
            for node in ast.walk(ast.parse(path.read_text(), rel)):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                        node.func.attr == "activate" and not node.args:
                    found.append(rel)
    assert sorted(set(found)) == sorted(ACTIVATORS), found
