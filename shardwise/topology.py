"""The one builder of process groups: a named process grid (which ranks share a pipeline stage, a
data-parallel replica, a tensor-parallel shard, a sequence, an expert) and every group cut from it.

Ranks are laid out by reshaping ``arange(world_size)`` into the grid with the last axis varying fastest
(``pipe, data, model`` by default, as DeepSpeed's ``PipeModelDataParallelTopology``), so tensor-parallel
peers are neighbours. A grid is cut from a ``ParallelDims`` (``ParallelGrid.from_dims``), the one record
of every axis's size, and hands its groups out by name: ``grid.group(axis)``, ``grid.size(axis)``,
``grid.axis_rank(axis)`` for ``data``, ``pipe``, ``model`` (tensor), ``sequence``, ``sequence_data``,
``model_parallel`` (pipe x tensor, DeepSpeed's ``get_model_parallel_*``), ``expert`` and
``expert_data``; ``grid.tied_group(stages)`` for layers tied across pipeline stages. The groups the
project uses are created here (and in ``shardwise.comm``), nowhere else: a test walks the sources.

Every group is created collectively: every rank creates every group of an axis, in the same order (a
rank keeps the one it belongs to). Groups created after the grid (a tied group, the expert groups of a
second ``ep_size``) are created on demand, but the demand is the same on every rank (the same model, the
same plan), so the order still agrees.

Building a grid changes nothing else: the grid is handed explicitly to what needs it. Code that takes no
grid argument (tensor-parallel layers built without ``group=``, DeepSpeed's ``deepspeed.utils.groups`` and
``parallel_state_sp`` accessors, Megatron-style ``mpu.get_*`` calls, an MoE layer built outside an
engine) asks the *active* grid (``active_grid()``): the one inside a ``with grid.active():`` scope,
else the activated one. Two callers activate a grid: ``shardwise.initialize`` (the engine's grid) and
``parallel_state_sp.initialize_sequence_parallel`` (the groups ``register_with_transformers`` lays out
before there is an engine); a user may too (``grid.activate()``, e.g. around building tensor-parallel
layers). ``comm.destroy_process_group`` forgets it, since its groups die with the world.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from collections import namedtuple
from itertools import product

from shardwise import comm
from shardwise.parallel_dims import ParallelDims, check_expert_size


class _Count(int):
    """A rank count that can also be called: ``topology.world_size`` and DeepSpeed's ``world_size()``."""

    def __call__(self) -> int:
        return int(self)


def _coord_type(axes: tuple[str, ...]) -> type:
    """DeepSpeed's ``ProcessCoord`` named tuple for ``axes``, also read by axis name like a dict."""

    class ProcessCoord(namedtuple("ProcessCoord", axes)):
        __slots__ = ()

        def __getitem__(self, key):
            return getattr(self, key) if isinstance(key, str) else super().__getitem__(key)

        def get(self, axis: str, default=None):
            return getattr(self, axis, default)

        def keys(self):  # so that ``get_rank(**coord)`` works
            return self._fields

    return ProcessCoord


@dataclass(frozen=True)
class ProcessTopology:
    """Ranks laid out row-major over named axes (the last axis varies fastest), with DeepSpeed's
    methods: ``get_rank(**coord)``, ``get_coord(rank)`` (a ``ProcessCoord`` named tuple),
    ``get_axis_list``, ``filter_match``, ``get_rank_repr``, ``get_axis_comm_lists``, ``world_size``."""

    axes: tuple[str, ...]
    dims: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "axes", tuple(self.axes))  # DeepSpeed's callers pass lists
        object.__setattr__(self, "dims", tuple(int(d) for d in self.dims))
        object.__setattr__(self, "ProcessCoord", _coord_type(self.axes))
        if len(self.axes) != len(self.dims):
            raise ValueError(f"topology axes {self.axes} and dims {self.dims} differ in length")
        if any(d < 1 for d in self.dims):
            raise ValueError(f"topology dims must be >= 1, got {dict(zip(self.axes, self.dims))}")

    def __reduce__(self):  # ProcessCoord is made per instance: rebuild it rather than pickle it
        return type(self), (self.axes, self.dims)

    @classmethod
    def for_world(cls, world_size: int, *, pipe: int = 1, model: int = 1) -> "ProcessTopology":
        if world_size % (pipe * model):
            raise ValueError(
                f"world size {world_size} is not divisible by pipeline ({pipe}) x model ({model}) parallel sizes"
            )
        return cls(("pipe", "data", "model"), (pipe, world_size // (pipe * model), model))

    @classmethod
    def from_dims(cls, dims: ParallelDims) -> "ProcessTopology":
        """The layout of ``dims``'s sizes, as DeepSpeed lays ranks out: pipe outermost, tensor fastest; with
        sequence parallelism (data, sequence), sequence fastest, and with pipe or tensor too (pipe, data,
        sequence, model): tensor peers stay neighbours, then sequence peers."""
        if dims.sequence > 1 and dims.pipe * dims.tensor == 1:
            return cls(("data", "sequence"), (dims.data, dims.sequence))
        if dims.sequence > 1:
            return cls(("pipe", "data", "sequence", "model"), (dims.pipe, dims.data, dims.sequence, dims.tensor))
        return cls(("pipe", "data", "model"), (dims.pipe, dims.data, dims.tensor))

    @property
    def world_size(self) -> int:
        n = 1
        for d in self.dims:
            n *= d
        return _Count(n)

    def get_dim(self, axis: str) -> int:
        return self.dims[self.axes.index(axis)]

    def get_coord(self, rank: int):
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} not found in topology {dict(zip(self.axes, self.dims))}")
        coord = []
        for dim in reversed(self.dims):
            coord.append(rank % dim)
            rank //= dim
        return self.ProcessCoord(*reversed(coord))

    def get_axis_list(self, axis: str, idx: int) -> list[int]:
        """The ranks whose coordinate along ``axis`` is ``idx``."""
        return self.filter_match(**{axis: idx})

    def filter_match(self, **coord: int) -> list[int]:
        """The ranks whose coordinates match every ``axis=value`` given, in rank order."""
        unknown = [a for a in coord if a not in self.axes]
        if unknown:
            raise ValueError(f"filter_match: no axis {unknown[0]!r} in topology {dict(zip(self.axes, self.dims))}")
        free = [a for a in self.axes if a not in coord]
        return sorted(self.get_rank(**coord, **dict(zip(free, values)))
                      for values in product(*[range(self.get_dim(a)) for a in free]))

    def get_rank_repr(self, rank: int, omit_axes=("data", "pipe"), inner_sep: str = "_", outer_sep: str = "-") -> str:
        """``rank``'s coordinates as text, e.g. ``model_01`` (DeepSpeed's checkpoint file names)."""
        coord = self.get_coord(rank)
        return outer_sep.join(f"{a}{inner_sep}{coord[a]:02d}" for a in self.axes if a not in set(omit_axes))

    def get_rank(self, **coord: int) -> int:
        rank = 0
        for axis, dim in zip(self.axes, self.dims):
            rank = rank * dim + coord.get(axis, 0)
        return rank

    def get_axis_names(self) -> list[str]:
        return list(self.axes)

    def get_axis_comm_lists(self, axis: str) -> list[list[int]]:
        """DeepSpeed's name for ``axis_groups`` (empty for an axis the topology lacks)."""
        return self.axis_groups(axis) if axis in self.axes else []

    def axis_groups(self, axis: str) -> list[list[int]]:
        """Lists of ranks that differ only in their coordinate along ``axis``."""
        others = [a for a in self.axes if a != axis]
        ranges = [range(self.get_dim(a)) for a in others]
        groups = []
        for fixed in product(*ranges):
            base = dict(zip(others, fixed))
            groups.append([self.get_rank(**base, **{axis: i}) for i in range(self.get_dim(axis))])
        return groups


class _Activatable:
    """``active()`` / ``activate()`` for a grid or a grid view (see the module docstring)."""

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

    def _alive(self) -> bool:
        return True

    @property
    def dims(self) -> ParallelDims:
        return ParallelDims(data=self.size("data"), pipe=self.size("pipe"), tensor=self.size("model"),
                            sequence=self.size("sequence"), expert=self.expert_size)

    # -- expert groups (MoE): a sub-axis of every stage's data x sequence (x tensor) ranks ----------------
    expert_size = 1  # the plan's expert-parallel size (``ParallelDims.expert``); see ``add_expert_axis``

    def add_expert_axis(self, ep_size: int) -> None:
        """Make ``ep_size`` this grid's expert axis (``group("expert")``, ``group("expert_data")``) and create
        its groups (collective). The expert axis is a sub-axis of data: adding it changes no other group."""
        self.expert_groups(ep_size)
        self.expert_size = int(ep_size)

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

    def _expert_rank_lists(self) -> list[list[int]]:
        raise NotImplementedError


_AXES = ("pipe", "data", "model", "sequence")  # the axes of the rank layout (each has a group per rank)
_EXPERT_AXES = ("expert", "expert_data")  # cut from the data axis (``ParallelGrid.expert_groups``)
# Groups the coming node-local (hpZ: ZeRO++'s secondary partition within a node) and replica
# (fault tolerance) features add are built here too: a method on ParallelGrid that cuts them from
# ``self.topology`` (collective, every rank the same order, cached on the grid like ``expert_groups``)
# and a name in ``group()``/``size()``/``axis_rank()``; nothing outside this module creates a group.
_NODE_AXES = ("node", "inter_node")  # cut from the data axis by node (``ParallelGrid.node_groups``)
_SCOPES: list = []
_DEFAULT: list = [None]


@dataclass(frozen=True)
class NodeGroups:
    """The data-parallel ranks cut by node, as this rank sees them (ZeRO++'s hpZ and qgZ). A rank's node is
    ``global_rank // node_size``. ``group``/``ranks``: the data ranks on this rank's node (hpZ's secondary
    partition, qgZ's intra-node exchange); ``cross_group``/``cross_ranks``: the data ranks holding this
    rank's place (k-th data rank of its node) on every node (qgZ's inter-node exchange)."""

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


_NODE_GROUPS: dict = {}  # (node_size, data rank lists) -> NodeGroups; forgotten with the world
comm.on_destroy(_NODE_GROUPS.clear)


def node_groups(data_rank_lists: list[list[int]], node_size: int) -> NodeGroups:
    """This rank's ``NodeGroups`` for nodes of ``node_size`` ranks, cut from every data-parallel group's
    ranks (``data_rank_lists``: all of them, the same on every rank). Collective the first time (every rank
    creates every group in the same order); cached after."""
    node_size = int(node_size)
    if node_size < 1:
        raise ValueError(f"node size must be >= 1, got {node_size}")
    lists = tuple(tuple(sorted(r)) for r in data_rank_lists)
    key = (node_size, lists)
    if key in _NODE_GROUPS:
        return _NODE_GROUPS[key]
    me, mine = comm.get_rank(), {}
    layouts = []
    for ranks in lists:
        by_node: dict[int, list[int]] = {}
        for r in ranks:
            by_node.setdefault(r // node_size, []).append(r)
        per_node = {len(v) for v in by_node.values()}
        if len(per_node) != 1:
            raise ValueError(f"data-parallel ranks {list(ranks)} are spread unevenly over nodes of {node_size} "
                             f"ranks ({ {n: len(v) for n, v in sorted(by_node.items())} } per node): ZeRO++ "
                             "needs the same number of data ranks on every node")
        local = [tuple(v) for _, v in sorted(by_node.items())]
        cross = [tuple(node[i] for node in local) for i in range(len(local[0]))]
        layouts.append((local, cross))
    for local, cross in layouts:  # every rank creates every group, in order
        for kind, lists_ in (("local", local), ("cross", cross)):
            for ranks in lists_:
                group = comm.new_group(list(ranks))
                if me in ranks:
                    mine[kind] = (group, ranks)
    made = NodeGroups(node_size, mine["local"][0], mine["local"][1], mine["cross"][0], mine["cross"][1])
    _NODE_GROUPS[key] = made
    return made


def active_grid():
    """The active grid (innermost ``with grid.active()`` scope, else the activated one), or None. A grid
    whose world group was destroyed (also by a direct ``torch.distributed.destroy_process_group()``) is
    never returned."""
    grid = _SCOPES[-1] if _SCOPES else _DEFAULT[0]
    if grid is not None and not grid._alive():
        _forget_grids()
        return None
    return grid


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
comm.on_destroy(_WORLD_EXPERTS.clear)


def _forget_grids() -> None:
    _SCOPES.clear()
    _DEFAULT[0] = None


comm.on_destroy(_forget_grids)


@dataclass(frozen=True)
class ExpertGroups:
    """The expert groups of one ``ep_size``, as this rank sees them. With a stage's data ranks
    d_0..d_{D-1} (DeepSpeed's order, see ``_stage_expert_ranks``) and expert-parallel size E, the
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


def split_data_ranks(data_ranks: list[int], ep: int, data_before_expert: bool = False):
    """(expert-parallel rank lists, expert-data-parallel rank lists) cut from one stage's data ranks."""
    blocks = len(data_ranks) // ep
    if data_before_expert:  # data-parallel replicas are the consecutive blocks instead
        return ([data_ranks[i::blocks] for i in range(blocks)],
                [data_ranks[i * blocks:(i + 1) * blocks] for i in range(ep)])
    return [data_ranks[i * ep:(i + 1) * ep] for i in range(blocks)], [data_ranks[i::ep] for i in range(ep)]


# Expert groups by layout, shared by every grid of the same world with the same layout (zero.Init cuts
# them before the engine's grid exists; the engine's grid then finds the same groups). Forgotten with the world.
_EXPERT_GROUPS_BY_LAYOUT: dict = {}


def _cut_expert_groups(stage_ranks: list[list[int]], ep: int, data_before_expert: bool) -> ExpertGroups:
    if ep < 1:
        raise ValueError(f"MoE ep_size must be >= 1, got {ep}")
    layout = []
    for data_ranks in stage_ranks:
        check_expert_size(ep, len(data_ranks))
        ep_lists, edp_lists = split_data_ranks(data_ranks, ep, data_before_expert)
        layout.append((tuple(map(tuple, ep_lists)), tuple(map(tuple, edp_lists))))
    layout = tuple(layout)
    key = (ep, layout)
    if key in _EXPERT_GROUPS_BY_LAYOUT:  # the same on every rank: every rank skips creating, or none does
        return _EXPERT_GROUPS_BY_LAYOUT[key]
    rank = comm.get_rank()
    mine = {}
    for ep_lists, edp_lists in layout:
        for kind, lists in (("data", edp_lists), ("expert", ep_lists)):  # every rank creates every group, in order
            for ranks in lists:
                group = comm.new_group(list(ranks))
                if rank in ranks:
                    mine[kind] = (group, ranks)
    made = ExpertGroups(ep, mine["expert"][0], mine["expert"][1], mine["data"][0], mine["data"][1], layout)
    _EXPERT_GROUPS_BY_LAYOUT[key] = made
    return made


comm.on_destroy(_EXPERT_GROUPS_BY_LAYOUT.clear)


def _stage_expert_ranks(topology: ProcessTopology) -> list[list[int]]:
    """Per pipeline stage, the ranks experts are split over, in DeepSpeed's order: tensor rank 0's data
    ranks, then tensor rank 1's, ... (TP-strided), each data rank followed by its sequence peers. With
    sequence parallelism every rank routes its own tokens; with tensor parallelism every tensor rank runs
    1 / tensor of each expert's slots. So expert-parallel groups (consecutive blocks) stay within one tensor
    rank, and an expert-data-parallel group spans the tensor ranks."""
    stages: dict[int, list[int]] = {}
    for rank in range(topology.world_size):
        stages.setdefault(topology.get_coord(rank).get("pipe", 0), []).append(rank)

    def order(rank):
        c = topology.get_coord(rank)
        return c.get("model", 0), c.get("data", 0), c.get("sequence", 0)

    return [sorted(ranks, key=order) for _, ranks in sorted(stages.items())]


def expert_rank_lists(world_size: int, tensor: int, ep: int, pipe: int = 1, data_before_expert: bool = False):
    """The expert-parallel and expert-data-parallel rank lists of a (pipe, data, tensor) layout, stage by stage
    (rank arithmetic only: no group is created)."""
    model = tensor * pipe
    if world_size % model:
        raise ValueError(f"world size {world_size} is not divisible by tensor {tensor} x pipe {pipe}")
    check_expert_size(ep, world_size // model)
    topology = ProcessTopology(("pipe", "data", "model"), (pipe, world_size // model, tensor))
    ep_all, edp_all = [], []
    for data_ranks in topology.axis_groups("data"):
        ep_lists, edp_lists = split_data_ranks(data_ranks, ep, data_before_expert)
        ep_all += ep_lists
        edp_all += edp_lists
    return ep_all, edp_all


class ParallelGrid(_Activatable):
    """The process groups of the current rank along each axis of a topology."""

    def __init__(self, topology: ProcessTopology, rank: int | None = None) -> None:
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
                g = comm.new_group(ranks)
                if self.rank in ranks:
                    self._groups[axis] = g
        for axis in _AXES:  # an axis the topology lacks has size 1: each rank a group of its own
            if axis not in topology.axes:
                for r in range(topology.world_size):
                    g = comm.new_group([r])
                    if r == self.rank:
                        self._groups[axis] = g
        self.coord = topology.get_coord(self.rank)
        self._model_parallel_group = self._build_model_parallel_group(whole_world)
        self._seq_data_group = self._groups.get("data")
        if "sequence" in topology.axes and topology.get_dim("sequence") > 1:
            self._seq_data_group = self._sequence_data_groups(whole_world)

    def _alive(self) -> bool:
        return comm.is_initialized() and self._world is comm.get_world_group()

    @classmethod
    def from_dims(cls, dims: ParallelDims) -> "ParallelGrid":
        """The grid of ``dims``'s sizes (collective: every rank builds every group), laid out by
        ``ProcessTopology.from_dims``."""
        grid = cls(ProcessTopology.from_dims(dims))
        if dims.expert > 1:
            grid.add_expert_axis(dims.expert)
        return grid

    def _expert_rank_lists(self) -> list[list[int]]:
        return _stage_expert_ranks(self.topology)

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
                group = comm.new_group(ranks)
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
            g = comm.new_group(ranks)
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
            g = comm.new_group(ranks)
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
    node_size = None  # ranks per node once ``add_node_axis`` ran (``group("node")``, ``group("inter_node")``)

    def data_rank_lists(self) -> list[list[int]]:
        """Every data-parallel group's ranks (data x sequence with sequence parallelism: what ZeRO reduces over)."""
        topo = self.topology
        axes = [a for a in ("data", "sequence") if a in topo.axes]
        others = [a for a in topo.axes if a not in axes]
        return [sorted(topo.get_rank(**dict(zip(others, fixed)), **dict(zip(axes, free)))
                       for free in product(*[range(topo.get_dim(a)) for a in axes]))
                for fixed in product(*[range(topo.get_dim(a)) for a in others])]

    def node_groups(self, node_size: int | None = None) -> NodeGroups:
        """This rank's data-parallel ranks cut by nodes of ``node_size`` ranks (default: the node axis's);
        collective on first use for a size, cached after (see ``topology.node_groups``)."""
        size = self.node_size if node_size is None else int(node_size)
        if size is None:
            raise ValueError("this grid has no node axis: call grid.add_node_axis(ranks_per_node) first")
        return node_groups(self.data_rank_lists(), size)

    def add_node_axis(self, node_size: int) -> NodeGroups:
        """Make nodes of ``node_size`` ranks this grid's node axis (``group("node")``: this rank's data
        ranks on its node; ``group("inter_node")``: its peers on the other nodes) and create the groups."""
        made = self.node_groups(node_size)
        self.node_size = int(node_size)
        return made

    def group(self, axis: str):
        """This rank's group along ``axis``: None when the axis spans the whole world (None is the
        world everywhere), a group of this rank alone when the axis has size 1. Also ``node`` and
        ``inter_node`` (after ``add_node_axis``: the data ranks on this rank's node, and its peers on the
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


def PipeDataParallelTopology(num_pp: int, num_dp: int) -> ProcessTopology:  # noqa: N802 (DeepSpeed's name)
    """Pipeline stages outermost, data-parallel replicas adjacent (DeepSpeed's class of the same name)."""
    return ProcessTopology(("pipe", "data"), (num_pp, num_dp))


def PipeModelDataParallelTopology(num_pp: int, num_mp: int, num_dp: int) -> ProcessTopology:  # noqa: N802
    return ProcessTopology(("pipe", "data", "model"), (num_pp, num_dp, num_mp))


def PipelineParallelGrid(topology: ProcessTopology | None = None, process_group=None) -> ParallelGrid:  # noqa: N802
    """DeepSpeed's grid class name: the grid of ``topology`` (default: data parallelism over every rank)."""
    if process_group is not None:
        raise ValueError("PipelineParallelGrid(process_group=...) is not supported (DeepSpeed ignores it too)")
    return ParallelGrid.for_topology(topology or ProcessTopology.for_world(comm.get_world_size()))


_MPU_AXES = ("data", "pipe", "model", "sequence")


class MpuGrid(_Activatable):
    """Adapter for a user's Megatron-style ``mpu`` object passed to ``initialize``.

    A sequence-parallel mpu (``shardwise.runtime.sequence_parallel.parallel_state_sp``, what
    ``UlyssesSPAttentionHF.register_with_transformers`` returns) has no data-parallel functions, as in
    DeepSpeed: its data-parallel size is world / sequence-parallel size, and ZeRO reduces over its
    sequence-data-parallel group.
    """

    def __init__(self, mpu) -> None:
        self.mpu = mpu
        self.expert_size = 1
        self._sequence_only = (hasattr(mpu, "get_sequence_parallel_world_size")
                               and not hasattr(mpu, "get_data_parallel_world_size"))

    def get_data_parallel_group(self):
        if self._sequence_only:
            return self.mpu.get_sequence_data_parallel_group()  # no data-only group; not used for reductions
        return self.mpu.get_data_parallel_group()

    def get_data_parallel_world_size(self) -> int:
        if self._sequence_only:
            return self.mpu.get_sequence_data_parallel_world_size() // self.mpu.get_sequence_parallel_world_size()
        return self.mpu.get_data_parallel_world_size()

    def get_data_parallel_rank(self) -> int:
        if self._sequence_only:
            return self.mpu.get_sequence_data_parallel_rank() // self.mpu.get_sequence_parallel_world_size()
        return self.mpu.get_data_parallel_rank()

    def get_model_parallel_world_size(self) -> int:
        return 1 if self._sequence_only else self.mpu.get_model_parallel_world_size()

    def get_model_parallel_rank(self) -> int:
        return 0 if self._sequence_only else self.mpu.get_model_parallel_rank()

    def get_model_parallel_group(self):
        fn = getattr(self.mpu, "get_model_parallel_group", None)
        return fn() if fn else None

    def get_tensor_model_parallel_world_size(self) -> int:
        fn = getattr(self.mpu, "get_tensor_model_parallel_world_size", None)
        return fn() if fn else self.get_model_parallel_world_size()

    def get_tensor_model_parallel_rank(self) -> int:
        fn = getattr(self.mpu, "get_tensor_model_parallel_rank", None)
        return fn() if fn else self.get_model_parallel_rank()

    def get_tensor_model_parallel_group(self):
        fn = getattr(self.mpu, "get_tensor_model_parallel_group", None)
        return fn() if fn else self.get_model_parallel_group()

    def get_pipe_parallel_world_size(self) -> int:
        fn = getattr(self.mpu, "get_pipe_parallel_world_size", None)
        return fn() if fn else 1

    def get_pipe_parallel_rank(self) -> int:
        fn = getattr(self.mpu, "get_pipe_parallel_rank", None)
        return fn() if fn else 0

    def get_pipe_parallel_group(self):
        fn = getattr(self.mpu, "get_pipe_parallel_group", None)
        return fn() if fn else None

    def _expert_rank_lists(self) -> list[list[int]]:
        """Every data-parallel group's ranks, gathered (the mpu's layout is not known here). Collective."""
        import torch.distributed as dist

        group = self.get_data_parallel_group()
        mine = dist.get_process_group_ranks(group) if group is not None else list(range(comm.get_world_size()))
        everyone = [None] * comm.get_world_size()
        dist.all_gather_object(everyone, sorted(mine))
        return [list(r) for r in sorted({tuple(r) for r in everyone})]

    def size(self, axis: str) -> int:
        if axis == "expert":
            return self.expert_size
        if axis == "expert_data":
            return self.expert_groups().data_size
        return {"data": self.get_data_parallel_world_size, "pipe": self.get_pipe_parallel_world_size,
                "model": self.get_tensor_model_parallel_world_size,
                "sequence": self.get_sequence_parallel_world_size}[axis]() if axis in _MPU_AXES else 1

    def axis_rank(self, axis: str) -> int:
        if axis in _EXPERT_AXES:
            return self.expert_groups().rank if axis == "expert" else self.expert_groups().data_rank
        return {"data": self.get_data_parallel_rank, "pipe": self.get_pipe_parallel_rank,
                "model": self.get_tensor_model_parallel_rank,
                "sequence": self.get_sequence_parallel_rank}[axis]() if axis in _MPU_AXES else 0

    def group(self, axis: str):
        if axis in _EXPERT_AXES:
            return self.expert_groups().group if axis == "expert" else self.expert_groups().data_group
        if axis == "sequence_data":
            return self.get_sequence_data_parallel_group()
        return {"data": self.get_data_parallel_group, "pipe": self.get_pipe_parallel_group,
                "model": self.get_tensor_model_parallel_group,
                "sequence": self.get_sequence_parallel_group}[axis]() if axis in _MPU_AXES else None

    def get_sequence_parallel_world_size(self) -> int:
        fn = getattr(self.mpu, "get_sequence_parallel_world_size", None)
        return fn() if fn else 1

    def get_sequence_parallel_group(self):
        fn = getattr(self.mpu, "get_sequence_parallel_group", None)
        return fn() if fn else None

    def get_sequence_parallel_rank(self) -> int:
        fn = getattr(self.mpu, "get_sequence_parallel_rank", None)
        return fn() if fn else 0

    def get_sequence_data_parallel_group(self):
        fn = getattr(self.mpu, "get_sequence_data_parallel_group", None)
        return fn() if fn else self.get_data_parallel_group()

    def get_sequence_data_parallel_world_size(self) -> int:
        fn = getattr(self.mpu, "get_sequence_data_parallel_world_size", None)
        return fn() if fn else self.get_data_parallel_world_size()

    def get_sequence_data_parallel_rank(self) -> int:
        fn = getattr(self.mpu, "get_sequence_data_parallel_rank", None)
        return fn() if fn else self.get_data_parallel_rank()
