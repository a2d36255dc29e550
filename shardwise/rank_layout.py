"""Where each rank sits in the process grid: rank arithmetic only, no process group.

``ProcessTopology`` lays ranks out by reshaping ``arange(world_size)`` over named axes with the last axis
varying fastest (``pipe, data, model`` by default, as DeepSpeed's ``PipeModelDataParallelTopology``), so
tensor-parallel peers are neighbours. The expert layout (``stage_expert_ranks``, ``split_data_ranks``) says
which ranks share an expert; the node layout (``zero_data_ranks``, ``node_rank_lists``) which data-parallel ranks
share a node (ZeRO++). The grid (``shardwise.topology.ParallelGrid``) creates the groups of these rank lists.
"""

from __future__ import annotations

from collections import namedtuple
from dataclasses import dataclass
from itertools import product

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shardwise.parallel_dims import ParallelDims

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


def PipeDataParallelTopology(num_pp: int, num_dp: int) -> ProcessTopology:  # noqa: N802 (DeepSpeed's name)
    """Pipeline stages outermost, data-parallel replicas adjacent (DeepSpeed's class of the same name)."""
    return ProcessTopology(("pipe", "data"), (num_pp, num_dp))


def PipeModelDataParallelTopology(num_pp: int, num_mp: int, num_dp: int) -> ProcessTopology:  # noqa: N802
    return ProcessTopology(("pipe", "data", "model"), (num_pp, num_dp, num_mp))



def split_data_ranks(data_ranks: list[int], ep: int, data_before_expert: bool = False):
    """(expert-parallel rank lists, expert-data-parallel rank lists) cut from one stage's data ranks."""
    blocks = len(data_ranks) // ep
    if data_before_expert:  # data-parallel replicas are the consecutive blocks instead
        return ([data_ranks[i::blocks] for i in range(blocks)],
                [data_ranks[i * blocks:(i + 1) * blocks] for i in range(ep)])
    return [data_ranks[i * ep:(i + 1) * ep] for i in range(blocks)], [data_ranks[i::ep] for i in range(ep)]



def stage_expert_ranks(topology: ProcessTopology) -> list[list[int]]:
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



def zero_data_ranks(topology: ProcessTopology) -> list[list[int]]:
    """Every data-parallel group's ranks: the data x sequence ranks of each other coordinate (pipe, model), what
    ZeRO partitions and reduces over (rank arithmetic only)."""
    axes = [a for a in ("data", "sequence") if a in topology.axes]
    others = [a for a in topology.axes if a not in axes]
    return [sorted(topology.get_rank(**dict(zip(others, fixed)), **dict(zip(axes, free)))
                   for free in product(*[range(topology.get_dim(a)) for a in axes]))
            for fixed in product(*[range(topology.get_dim(a)) for a in others])]


def node_rank_lists(data_ranks, node_size: int) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]]:
    """``(local, cross)``: one data-parallel group's ranks cut by node, a rank's node being
    ``rank // node_size``. ``local``: the group's ranks on each node, node by node (hpZ's secondary partition,
    qgZ's exchange inside a node); ``cross``: the ranks holding the same place on every node (the k-th data rank
    of each node: qgZ's exchange across nodes). ``ValueError`` when the nodes hold different numbers of the
    group's ranks."""
    node_size = int(node_size)
    if node_size < 1:
        raise ValueError(f"node size must be >= 1, got {node_size}")
    by_node: dict[int, list[int]] = {}
    for r in sorted(int(r) for r in data_ranks):
        by_node.setdefault(r // node_size, []).append(r)
    counts = {n: len(v) for n, v in sorted(by_node.items())}
    if len(set(counts.values())) != 1:
        raise ValueError(f"data-parallel ranks {sorted(data_ranks)} are spread unevenly over nodes of {node_size} "
                         f"ranks ({counts} per node): ZeRO++ needs the same number of data ranks on every node")
    local = [tuple(v) for _, v in sorted(by_node.items())]
    cross = [tuple(node[i] for node in local) for i in range(len(local[0]))]
    return local, cross


def expert_divides(ep: int, routing_ranks: int) -> bool:
    """Whether an expert size ``ep`` splits ``routing_ranks`` (a stage's data x sequence ranks: every one
    routes its own tokens) into whole expert-parallel groups: the one "ep divides data" check."""
    return routing_ranks % ep == 0


def check_expert_size(ep: int, routing_ranks: int, *, key: str = "MoE ep_size") -> None:
    """Raise ``ValueError`` naming ``key`` when ``ep`` does not divide ``routing_ranks``."""
    if not expert_divides(ep, routing_ranks):
        raise ValueError(f"{key}={ep} does not divide the data-parallel size {routing_ranks} (times "
                         "sequence_parallel_size): the experts of a layer are split over that many ranks of the "
                         "data axis")
