"""The one builder of process groups: the grid of every group the project uses, cut from one rank layout
and handed out by name.

A ``ParallelGrid`` is built from a ``ParallelDims`` (``ParallelGrid.from_dims``), the one record of every
axis's size, once the plan knows every size (``shardwise/runtime/plan.py``). Its rank layout is a
``ProcessTopology`` (``shardwise/rank_layout.py``: rank arithmetic only). It hands its groups out by name:
``grid.group(axis)``, ``grid.size(axis)``, ``grid.axis_rank(axis)`` for ``data``, ``pipe``, ``model``
(tensor), ``sequence``, ``sequence_data``, ``model_parallel`` (pipe x tensor, DeepSpeed's
``get_model_parallel_*``), ``expert`` and ``expert_data``, ``node`` and ``inter_node`` (ZeRO++: each data-parallel
group cut by node, ``ParallelDims.node_size``); ``grid.tied_group(stages)`` for layers tied across pipeline
stages. The groups the project uses are created here (and in ``shardwise.comm``), nowhere else: a
test walks the sources.

Every group is created collectively: every rank creates every group of an axis, in the same order (a
rank keeps the one it belongs to). A group is created once per list of ranks and world (``_group``): a grid
built for the same ranks again (the engine's grid after the one a ``PipelineModule`` or
``register_with_transformers`` needed earlier) finds the groups that exist. Groups asked for after the grid
(a tied group, the expert groups of a second ``ep_size``) are created on demand, but the demand is the same
on every rank (the same model, the same plan), so the order still agrees.

Building a grid changes nothing else: the grid is handed explicitly to what needs it. Code that takes no
grid argument (tensor-parallel layers built without ``group=``, DeepSpeed's group accessors in the compat
package, an MoE layer built outside an engine) asks the *active* grid (``active_grid()``): the one inside
a ``with grid.active():`` scope, else the activated one. Two callers activate a grid: ``shardwise.initialize``
(the engine's grid) and ``shardwise.runtime.sequence_parallel.groups.sequence_parallel_grid`` (the groups
``register_with_transformers`` lays out before there is an engine); a user may too (``grid.activate()``,
e.g. around building tensor-parallel layers). ``comm.destroy_process_group`` forgets it, since its groups
die with the world.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from itertools import product

from shardwise import comm
from shardwise.parallel_dims import ParallelDims, check_expert_size
from shardwise.rank_layout import (  # noqa: F401 (the layout's names, where callers import them from)
    PipeDataParallelTopology,
    PipeModelDataParallelTopology,
    ProcessTopology,
    expert_rank_lists,
    node_rank_lists,
    split_data_ranks,
    stage_expert_ranks,
    zero_data_ranks,
)

_AXES = ("pipe", "data", "model", "sequence")  # the axes of the rank layout (each has a group per rank)
_EXPERT_AXES = ("expert", "expert_data")  # cut from the data axis (``ParallelGrid.expert_groups``)
_NODE_AXES = ("node", "inter_node")  # cut from the data axis by node (``ParallelGrid.node_groups``)
# A group a coming feature needs is built here too: cut from ``self.topology`` in ``ParallelGrid.__init__``
# from a size in ``ParallelDims`` (collective, every rank the same order, each rank list once: ``_group``), and
# a name in ``group()``/``size()``/``axis_rank()``; nothing outside this module (and ``shardwise.comm``) creates
# a group. (Fault tolerance's replica axis is torchft's own process group, re-formed by its manager.)
_SCOPES: list = []
_DEFAULT: list = [None]
_GROUPS: dict = {}  # every group created, by its ranks (this world's; forgotten with it)


def _group(ranks):
    """The process group of ``ranks`` (sorted or in the order given), created on first use. Collective: every
    rank asks for every group of an axis in the same order, so every rank creates it, or none does."""
    key = tuple(int(r) for r in ranks)
    if key not in _GROUPS:
        _GROUPS[key] = comm.new_group(list(key))
    return _GROUPS[key]


@dataclass(frozen=True)
class NodeGroups:
    """The data-parallel ranks cut by node, as this rank sees them (ZeRO++'s hpZ and qgZ; the grid's ``node``
    and ``inter_node`` groups). A rank's node is ``global_rank // node_size``. ``group``/``ranks``: the data
    ranks on this rank's node (hpZ's secondary partition, qgZ's intra-node exchange); ``cross_group``/
    ``cross_ranks``: the data ranks holding this rank's place (k-th data rank of its node) on every node (qgZ's
    inter-node exchange)."""

    node_size: int
    group: object
    ranks: tuple
    cross_group: object
    cross_ranks: tuple

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def rank(self) -> int:
        return self.ranks.index(comm.get_rank())

    @property
    def nodes(self) -> int:
        return len(self.cross_ranks)

    @property
    def node(self) -> int:
        return self.cross_ranks.index(comm.get_rank())


def _cut_node_groups(data_rank_lists, node_size: int) -> NodeGroups:
    """This rank's ``NodeGroups`` for nodes of ``node_size`` ranks, cut from every data-parallel group's ranks
    (``data_rank_lists``: all of them, the same on every rank; ``rank_layout.node_rank_lists``). Collective: every
    rank creates every group in the same order (each list of ranks once, ``_group``)."""
    me, mine = comm.get_rank(), {}
    layouts = [node_rank_lists(ranks, node_size) for ranks in data_rank_lists]  # (uneven nodes: ValueError)
    for local, cross in layouts:  # every rank creates every group, in order
        for kind, lists in (("local", local), ("cross", cross)):
            for ranks in lists:
                group = _group(ranks)
                if me in ranks:
                    mine[kind] = (group, tuple(ranks))
    return NodeGroups(int(node_size), mine["local"][0], mine["local"][1], mine["cross"][0], mine["cross"][1])


def world_node_groups(node_size: int) -> NodeGroups:
    """The node groups of the whole world's data axis (every rank a data rank), for ZeRO++ used without a grid
    (a ZeRO-3 strategy built outside ``initialize``). Collective the first time; cached with the world."""
    key = int(node_size)
    if key not in _WORLD_NODES:
        _WORLD_NODES[key] = _cut_node_groups([list(range(comm.get_world_size()))], key)
    return _WORLD_NODES[key]


def active_grid():
    """The active grid (innermost ``with grid.active()`` scope, else the activated one), or None. A grid
    whose world group was destroyed (also by a direct ``torch.distributed.destroy_process_group()``) is
    never returned."""
    grid = _SCOPES[-1] if _SCOPES else _DEFAULT[0]
    if grid is not None and not grid._alive():
        _forget_grids()
        return None
    return grid


_VIEWS: dict = {}  # id(object) -> (object, resolve): objects that stand for a grid (``register_grid_view``)


def register_grid_view(view, resolve) -> None:
    """Declare that ``view`` (an object or module answering group accessors, e.g. DeepSpeed's
    ``parallel_state_sp`` in the compat package) stands for the grid ``resolve()`` returns: ``initialize(mpu=view)``
    takes that grid's sizes and groups."""
    _VIEWS[id(view)] = (view, resolve)


def grid_of_view(view):
    """The grid a registered view stands for (``register_grid_view``), or None for any other object."""
    entry = _VIEWS.get(id(view))
    return entry[1]() if entry is not None and entry[0] is view else None


def expert_groups(ep_size: int, *, data_before_expert: bool = False, grid=None) -> "ExpertGroups":
    """The ``ep_size`` expert groups of ``grid``, else of the active grid, else cut from the whole world's
    data axis (an MoE layer or ``zero.Init`` used before any grid: every rank is a data rank). Collective
    the first time (see ``ParallelGrid.expert_groups``)."""
    grid = grid if grid is not None else active_grid()
    if grid is not None:
        return grid.expert_groups(ep_size, data_before_expert=data_before_expert)
    key = (int(ep_size), bool(data_before_expert))
    if key not in _WORLD_EXPERTS:
        _WORLD_EXPERTS[key] = _cut_expert_groups([list(range(comm.get_world_size()))], *key)
    return _WORLD_EXPERTS[key]


def created_expert_groups() -> dict:
    """``{ep_size: ExpertGroups}`` created so far on the active grid (else cut from the world's data axis)."""
    grid = active_grid()
    if grid is not None:
        return grid.created_expert_groups()
    return {ep: g for (ep, _), g in sorted(_WORLD_EXPERTS.items())}


_WORLD_EXPERTS: dict = {}  # expert groups cut with no grid active (forgotten with the world)
_WORLD_NODES: dict = {}  # node groups cut with no grid (forgotten with the world)


def _forget_grids() -> None:
    _SCOPES.clear()
    _DEFAULT[0] = None


def _forget_world() -> None:
    _GROUPS.clear()
    _WORLD_EXPERTS.clear()
    _WORLD_NODES.clear()


comm.on_destroy(_forget_world)
comm.on_destroy(_forget_grids)


@dataclass(frozen=True)
class ExpertGroups:
    """The expert groups of one ``ep_size``, as this rank sees them. With a stage's data ranks
    d_0..d_{D-1} (DeepSpeed's order, see ``rank_layout.stage_expert_ranks``) and expert-parallel size E, the
    expert-parallel groups are consecutive blocks [d_0..d_{E-1}], ... (tokens are exchanged within one),
    the expert-data-parallel groups strided ones [d_0, d_E, ...], ... (expert gradients are reduced over
    one). ``layout``: every stage's (expert-parallel, expert-data-parallel) rank lists."""

    size: int
    group: object  # this rank's expert-parallel group
    ranks: tuple
    data_group: object  # this rank's expert-data-parallel group
    data_ranks: tuple
    layout: tuple

    @property
    def rank(self) -> int:
        return self.ranks.index(comm.get_rank())

    @property
    def data_size(self) -> int:
        return len(self.data_ranks)

    @property
    def data_rank(self) -> int:
        return self.data_ranks.index(comm.get_rank())



def _cut_expert_groups(stage_ranks: list[list[int]], ep: int, data_before_expert: bool) -> ExpertGroups:
    if ep < 1:
        raise ValueError(f"MoE ep_size must be >= 1, got {ep}")
    layout = []
    for data_ranks in stage_ranks:
        check_expert_size(ep, len(data_ranks))
        ep_lists, edp_lists = split_data_ranks(data_ranks, ep, data_before_expert)
        layout.append((tuple(map(tuple, ep_lists)), tuple(map(tuple, edp_lists))))
    layout = tuple(layout)
    rank = comm.get_rank()
    mine = {}
    for ep_lists, edp_lists in layout:
        for kind, lists in (("data", edp_lists), ("expert", ep_lists)):  # every rank creates every group, in order
            for ranks in lists:
                group = _group(ranks)
                if rank in ranks:
                    mine[kind] = (group, ranks)
    return ExpertGroups(ep, mine["expert"][0], mine["expert"][1], mine["data"][0], mine["data"][1], layout)




class ParallelGrid:
    """The process groups of the current rank along each axis of a topology, its expert axis (``expert``
    ranks of every stage's data x sequence ranks share a layer's experts; 1: none) and its node axis
    (``node_size`` consecutive ranks are a node; ZeRO++ cuts each data-parallel group by node; 0: none)."""

    def __init__(self, topology: ProcessTopology, rank: int | None = None, *, expert: int = 1,
                 node_size: int = 0) -> None:
        self.topology = topology
        self.rank = comm.get_rank() if rank is None else rank
        self._world = comm.get_world_group() if comm.is_initialized() else None
        self._groups = {}
        whole_world = topology.world_size == comm.get_world_size()
        for axis in topology.axes:
            groups = topology.axis_groups(axis)
            if len(groups) == 1 and whole_world:
                self._groups[axis] = None  # the default group: no new communicator needed
                continue
            for ranks in groups:  # every rank creates every group, in the same order
                # A size-1 axis gets a group of its own too: None means the whole world everywhere
                # (the ZeRO strategy reducing over a size-1 data axis, a user's all-reduce over the
                # tensor group at tensor size 1), as in Megatron's and DeepSpeed's grids.
                g = _group(ranks)
                if self.rank in ranks:
                    self._groups[axis] = g
        for axis in _AXES:  # an axis the topology lacks has size 1: each rank a group of its own
            if axis not in topology.axes:
                for r in range(topology.world_size):
                    g = _group([r])
                    if r == self.rank:
                        self._groups[axis] = g
        self.coord = topology.get_coord(self.rank)
        self._model_parallel_group = self._build_model_parallel_group(whole_world)
        self._seq_data_group = self._groups.get("data")
        if "sequence" in topology.axes and topology.get_dim("sequence") > 1:
            self._seq_data_group = self._sequence_data_groups(whole_world)
        self.expert_size = int(expert)
        if self.expert_size > 1:
            self.expert_groups(self.expert_size)  # the expert axis: a sub-axis of data (collective)
        self.node_size = int(node_size)
        self._nodes = None
        if self.node_size > 0:  # the node axis: each data-parallel group cut by node (collective)
            self._nodes = _cut_node_groups(self.data_rank_lists(), self.node_size)

    def _alive(self) -> bool:
        return comm.is_initialized() and self._world is comm.get_world_group()

    @classmethod
    def from_dims(cls, dims: ParallelDims, topology: ProcessTopology | None = None) -> "ParallelGrid":
        """The grid of ``dims``'s sizes, expert and node axes included (collective: every rank builds every
        group), laid out by ``topology`` (a ``PipelineModule``'s or a user's grid's) or else
        ``ProcessTopology.from_dims``."""
        if topology is None:
            topology = ProcessTopology.from_dims(dims)
        else:
            has = {a: topology.get_dim(a) if a in topology.axes else 1 for a in _AXES}
            want = {"pipe": dims.pipe, "data": dims.data, "model": dims.tensor, "sequence": dims.sequence}
            if has != want:
                raise ValueError(f"topology {dict(zip(topology.axes, topology.dims))} does not have the sizes {want}")
        return cls(topology, expert=dims.expert, node_size=dims.node_size)

    def _expert_rank_lists(self) -> list[list[int]]:
        return stage_expert_ranks(self.topology)

    @contextlib.contextmanager
    def active(self):
        """Make this grid the active one inside the ``with`` block (e.g. while building a model from
        tensor-parallel layers, or running its forward)."""
        _SCOPES.append(self)
        try:
            yield self
        finally:
            _SCOPES.pop()

    def activate(self) -> None:
        """Make this grid the active one outside any ``with grid.active()`` scope, until another is
        activated or the process group is destroyed (what ``initialize`` does with the engine's grid)."""
        _DEFAULT[0] = self

    @property
    def dims(self) -> ParallelDims:
        return ParallelDims(data=self.size("data"), pipe=self.size("pipe"), tensor=self.size("model"),
                            sequence=self.size("sequence"), expert=self.expert_size, node_size=self.node_size)

    # -- expert groups (MoE): a sub-axis of every stage's data x sequence (x tensor) ranks ----------------
    def expert_groups(self, ep_size: int | None = None, *, data_before_expert: bool = False,
                      create: bool = True) -> "ExpertGroups | None":
        """This rank's expert-parallel and expert-data-parallel groups for ``ep_size`` (default: the grid's
        expert size), created on first use (collective: every rank asks for the same sizes in the same
        order, as the same model's MoE layers do). ``create=False``: None when they do not exist yet."""
        ep = self.expert_size if ep_size is None else int(ep_size)
        key = (ep, bool(data_before_expert))
        made = self.__dict__.setdefault("_experts", {})
        if key not in made and create:
            made[key] = _cut_expert_groups(self._expert_rank_lists(), ep, bool(data_before_expert))
        return made.get(key)

    def created_expert_groups(self) -> dict:
        """``{ep_size: ExpertGroups}`` of the groups created so far on this grid (DeepSpeed's name-keyed views)."""
        return {ep: g for (ep, _), g in sorted(self.__dict__.get("_experts", {}).items())}

    def tied_group(self, stages) -> tuple:
        """``(group, ranks)``: the group of the pipeline ``stages`` at this rank's other coordinates (layers
        tied across those stages sum their gradients over it); ``(None, ranks)`` when this rank is on none of
        them. Collective on first use for a set of stages: every rank creates every such group (one per
        data x tensor coordinate), in the same order; cached after."""
        stages = tuple(sorted(int(s) for s in stages))
        made = self.__dict__.setdefault("_tied", {})
        if stages not in made:
            topo, mine = self.topology, (None, [])
            others = [a for a in topo.axes if a != "pipe"]
            for column in topo.axis_groups("pipe"):  # one group per (data, model) coordinate
                base = {a: v for a, v in topo.get_coord(column[0])._asdict().items() if a in others}
                ranks = [topo.get_rank(**base, pipe=s) for s in stages]
                group = _group(ranks)
                if self.rank in ranks:
                    mine = (group, ranks)
            made[stages] = mine
        return made[stages]

    def _build_model_parallel_group(self, whole_world: bool):
        """The ranks sharing this rank's data (and sequence) coordinate: every pipe and model coordinate."""
        if self.size("data") * self.size("sequence") == 1 and whole_world:
            return None  # the whole world
        mine = None
        topo = self.topology
        others = [a for a in topo.axes if a not in ("data", "sequence")]
        for d, s in product(range(self.size("data")), range(self.size("sequence"))):
            fixed = {a: v for a, v in (("data", d), ("sequence", s)) if a in topo.axes}
            ranks = sorted(topo.get_rank(**fixed, **dict(zip(others, free)))  # O(group size), not O(world)
                           for free in product(*[range(topo.get_dim(a)) for a in others]))
            g = _group(ranks)
            if self.rank in ranks:
                mine = g
        return mine

    def _sequence_data_groups(self, whole_world: bool):
        """The group of ranks differing only in their data and sequence coordinates (ZeRO reduces over it)."""
        others = [a for a in self.topology.axes if a not in ("data", "sequence")]
        if all(self.topology.get_dim(a) == 1 for a in others) and whole_world:
            return None
        mine = None
        for fixed in product(*[range(self.topology.get_dim(a)) for a in others]):
            base = dict(zip(others, fixed))
            ranks = sorted(self.topology.get_rank(**base, data=d, sequence=s)
                           for d in range(self.topology.get_dim("data"))
                           for s in range(self.topology.get_dim("sequence")))
            g = _group(ranks)
            if self.rank in ranks:
                mine = g
        return mine

    @classmethod
    def data_parallel_only(cls) -> "ParallelGrid":
        return cls(ProcessTopology.for_world(comm.get_world_size()))

    @classmethod
    def for_topology(cls, topology: ProcessTopology) -> "ParallelGrid":
        """The active grid if it has this topology (its groups exist already), else a new one.
        Collective when it builds: every rank must call it with the same topology."""
        current = active_grid()
        if isinstance(current, ParallelGrid) and current.topology == topology and current.rank == comm.get_rank():
            return current
        return cls(topology)

    # -- node groups (ZeRO++): the data-parallel ranks cut by node ---------------------------------
    def data_rank_lists(self) -> list[list[int]]:
        """Every data-parallel group's ranks (data x sequence with sequence parallelism: what ZeRO reduces over)."""
        return zero_data_ranks(self.topology)

    def node_groups(self) -> NodeGroups:
        """This rank's data-parallel ranks cut by node (``group("node")``: those on its node; ``group("inter_node")``:
        its peers, one per node), created with the grid from ``ParallelDims.node_size``."""
        if self._nodes is None:
            raise ValueError("this grid has no node axis (its ParallelDims.node_size is 0): ZeRO++'s hpZ and qgZ need "
                             "one; initialize builds it when zero_optimization turns them on, else build the grid with "
                             "ParallelGrid.from_dims(dims.replace(node_size=ranks_per_node))")
        return self._nodes

    def group(self, axis: str):
        """This rank's group along ``axis``: None when the axis spans the whole world (None is the
        world everywhere), a group of this rank alone when the axis has size 1. Also ``node`` and
        ``inter_node`` (with a node axis: the data ranks on this rank's node, and its peers on the
        other nodes), ``sequence_data``
        (the data x sequence ranks ZeRO reduces over with sequence parallelism), ``model_parallel``
        (pipe x tensor), ``expert`` and ``expert_data`` (of the grid's expert size)."""
        if axis in _EXPERT_AXES:
            experts = self.expert_groups()
            return experts.group if axis == "expert" else experts.data_group
        if axis in _NODE_AXES:
            nodes = self.node_groups()
            return nodes.group if axis == "node" else nodes.cross_group
        if axis == "sequence_data":
            return self._seq_data_group
        if axis == "model_parallel":
            return self._model_parallel_group
        return self._groups[axis]

    def size(self, axis: str) -> int:
        if axis == "expert":
            return self.expert_size
        if axis in _NODE_AXES:
            nodes = self.node_groups()
            return nodes.size if axis == "node" else nodes.nodes
        if axis == "expert_data":
            return self.expert_groups().data_size
        if axis == "sequence_data":
            return self.size("data") * self.size("sequence")
        if axis == "model_parallel":
            return self.size("pipe") * self.size("model")
        return self.topology.get_dim(axis) if axis in self.topology.axes else 1

    def axis_rank(self, axis: str) -> int:
        if axis == "expert":
            return self.expert_groups().rank
        if axis in _NODE_AXES:
            nodes = self.node_groups()
            return nodes.rank if axis == "node" else nodes.node
        if axis == "expert_data":
            return self.expert_groups().data_rank
        if axis == "sequence_data":
            return self.get_sequence_data_parallel_rank()
        if axis == "model_parallel":
            return self.get_model_parallel_rank()
        return self.coord.get(axis, 0)

    # -- pipeline stages ------------------------------------------------------------------------
    @property
    def stage_id(self) -> int:
        return self.axis_rank("pipe")

    def get_stage_id(self) -> int:
        return self.stage_id

    def stage_to_global(self, stage_id: int, **coord: int) -> int:
        """The global rank of ``stage_id`` at this rank's other coordinates (or those given)."""
        base = {a: self.coord[a] for a in self.topology.axes if a != "pipe"}
        base.update(coord)
        return self.topology.get_rank(**base, pipe=stage_id % self.size("pipe"))

    @property
    def prev_stage_rank(self) -> int:
        """The rank one stage back (stage 0's is the last stage: interleaved schedules wrap)."""
        return self.stage_to_global(self.stage_id - 1)

    @property
    def next_stage_rank(self) -> int:
        return self.stage_to_global(self.stage_id + 1)

    def is_first_stage(self) -> bool:
        return self.stage_id == 0

    def is_last_stage(self) -> bool:
        return self.stage_id == self.size("pipe") - 1

    def get_pipe_parallel_group(self):
        return self.group("pipe")

    def get_pipe_parallel_rank(self) -> int:
        return self.stage_id

    # Megatron/DeepSpeed "mpu" names, so a grid can be passed where an mpu is expected.
    def get_data_parallel_group(self):
        return self.group("data")

    def get_data_parallel_world_size(self) -> int:
        return self.size("data")

    def get_data_parallel_rank(self) -> int:
        return self.axis_rank("data")

    def get_data_parallel_group_ranks(self) -> list[int]:
        return self._axis_ranks("data")

    # "model parallel" is every parallelism but data (pipe x tensor), as in DeepSpeed's grid.
    def get_model_parallel_world_size(self) -> int:
        return self.size("pipe") * self.size("model")

    def get_model_parallel_rank(self) -> int:
        return self.stage_id * self.size("model") + self.axis_rank("model")

    def get_model_parallel_group(self):
        return self._model_parallel_group

    def get_pipe_parallel_world_size(self) -> int:
        return self.size("pipe")

    # The tensor-parallel ("model") axis: Megatron's tensor_model_parallel, DeepSpeed's "slice".
    def get_tensor_model_parallel_world_size(self) -> int:
        return self.size("model")

    def get_tensor_model_parallel_rank(self) -> int:
        return self.axis_rank("model")

    def get_tensor_model_parallel_group(self):
        return self.group("model")

    def get_tensor_model_parallel_src_rank(self) -> int:
        """The global rank of tensor rank 0 in this rank's tensor group."""
        return self._axis_ranks("model")[0]

    get_slice_parallel_world_size = get_tensor_model_parallel_world_size
    get_slice_parallel_rank = get_tensor_model_parallel_rank
    get_slice_parallel_group = get_tensor_model_parallel_group
    get_pipeline_model_parallel_world_size = get_pipe_parallel_world_size
    get_pipeline_model_parallel_rank = get_pipe_parallel_rank

    def _axis_ranks(self, axis: str) -> list[int]:
        if axis not in self.topology.axes:
            return [self.rank]
        return next(g for g in self.topology.axis_groups(axis) if self.rank in g)

    def get_global_rank(self) -> int:
        return self.rank

    # -- sequence parallelism (Ulysses): the attention's group, and the group ZeRO reduces over --------
    def get_sequence_parallel_group(self):
        return self.group("sequence")

    def get_sequence_parallel_world_size(self) -> int:
        return self.size("sequence")

    def get_sequence_parallel_rank(self) -> int:
        return self.axis_rank("sequence")

    def get_sequence_data_parallel_group(self):
        return self._seq_data_group

    def get_sequence_data_parallel_world_size(self) -> int:
        return self.size("data") * self.size("sequence")

    def get_sequence_data_parallel_rank(self) -> int:
        return self.axis_rank("data") * self.size("sequence") + self.axis_rank("sequence")


class _GroupMarker:
    """A named stand-in for a process group in ``shardwise.tensor_parallel`` (never passed to ``comm``)."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __repr__(self) -> str:
        return self._name


# ``group=None`` means the whole world everywhere in shardwise (comm, zero, tensor_parallel, as in
# torch.distributed). The tensor-parallel layers and regions default to TENSOR_AXIS instead: the active
# grid's tensor axis, resolved once when a layer is built (or a region called). ONE_RANK is what that
# resolves to without tensor parallelism: a group of this rank alone, so nothing is communicated.
TENSOR_AXIS = _GroupMarker("TENSOR_AXIS")
ONE_RANK = _GroupMarker("ONE_RANK")


def tensor_parallel_group_and_size(group=TENSOR_AXIS):
    """(group, size) of a tensor-parallel region: ``group`` itself (None: the whole world), or for
    TENSOR_AXIS the active grid's tensor axis (ONE_RANK, size 1, when there is none or it has size 1)."""
    if group is ONE_RANK:
        return ONE_RANK, 1
    if group is not TENSOR_AXIS:
        return group, comm.get_world_size(group)
    grid = active_grid()
    if grid is None or grid.size("model") == 1:
        return ONE_RANK, 1
    return grid.group("model"), grid.size("model")  # None when the tensor axis is the whole world
