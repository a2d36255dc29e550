"""``deepspeed.checkpoint.reshape_meg_2d``: the (pipeline stage, tensor rank) -> source-file map of a
Megatron-style 2-D model-parallel checkpoint, and its contraction to smaller degrees.

Model-state file ``i`` of a ``pp x tp`` checkpoint belongs to stage ``i // tp``, tensor rank ``i % tp``.
Shrinking the tensor degree gives each new tensor rank a consecutive run of a stage's old files; shrinking
the pipeline degree then gives each new stage a consecutive run of a tensor rank's files. Only contraction is
possible (a new degree must divide the old one)."""
from deepspeed.checkpoint.reshape_utils import partition_data

__all__ = ["get_mpu_ranks", "meg_2d_parallel_map", "partition_data", "reshape", "reshape_meg_2d_parallel"]


class meg_2d_parallel_map:  # noqa: N801 (DeepSpeed's name)
    """Lists of source indices keyed by (pipeline index, tensor index)."""

    def __init__(self, pp_degree, tp_degree):
        self.pp_degree = pp_degree
        self.tp_degree = tp_degree
        self.map = {}

    def simple_init(self):
        """The identity layout: file ``i`` at (``i // tp``, ``i % tp``)."""
        self.map = {self._make_key(i // self.tp_degree, i % self.tp_degree): [i]
                    for i in range(self.pp_degree * self.tp_degree)}

    def add_data(self, pp_index, tp_index, data):
        self._validate_indices(pp_index, tp_index)
        assert type(data) is list
        self.map.setdefault(self._make_key(pp_index, tp_index), []).extend(data)

    def get_data(self, pp_index=None, tp_index=None):
        """The indices at (pp_index, tp_index); ``None`` for either means every index of that dimension,
        stage-major."""
        self._validate_indices(pp_index, tp_index)
        stages = range(self.pp_degree) if pp_index is None else [pp_index]
        ranks = range(self.tp_degree) if tp_index is None else [tp_index]
        return [idx for i in stages for j in ranks for idx in self.map[self._make_key(i, j)]]

    def print_data(self, tag):
        print(tag)
        for key, value in self.map.items():
            print(f"{key} = {value}")

    def _validate_indices(self, pp_index, tp_index):
        assert pp_index is None or pp_index < self.pp_degree
        assert tp_index is None or tp_index < self.tp_degree

    def _make_key(self, i, j):
        return f"{i},{j}"


def _contract_tp(old_map, new_tp_degree):
    new_map = meg_2d_parallel_map(old_map.pp_degree, new_tp_degree)
    for stage in range(old_map.pp_degree):
        pieces = partition_data(old_map.get_data(pp_index=stage, tp_index=None), new_tp_degree)
        for rank, piece in enumerate(pieces):
            new_map.add_data(stage, rank, piece)
    return new_map


def _contract_pp(old_map, new_pp_degree):
    new_map = meg_2d_parallel_map(new_pp_degree, old_map.tp_degree)
    for rank in range(old_map.tp_degree):
        pieces = partition_data(old_map.get_data(pp_index=None, tp_index=rank), new_pp_degree)
        for stage, piece in enumerate(pieces):
            new_map.add_data(stage, rank, piece)
    return new_map


def reshape_meg_2d_parallel(old_pp_degree, old_tp_degree, new_pp_degree, new_tp_degree, verbose=False):
    """The map from each new (stage, tensor rank) to the old model-state file indices it merges."""
    assert new_pp_degree <= old_pp_degree
    assert new_tp_degree <= old_tp_degree
    current = meg_2d_parallel_map(old_pp_degree, old_tp_degree)
    current.simple_init()
    if verbose:
        current.print_data("original_2d_map:")
    if new_tp_degree != old_tp_degree:
        current = _contract_tp(current, new_tp_degree)
    if verbose:
        current.print_data("after_tp_reshape:")
    if new_pp_degree != old_pp_degree:
        current = _contract_pp(current, new_pp_degree)
    if verbose:
        current.print_data("final_2d_map:")
    return current


def get_mpu_ranks(tp_size=1, pp_size=1, dp_size=1, virtual_pp_size=None):
    """Megatron's rank groups for ``tp x pp x dp`` ranks: tensor groups are consecutive ranks, data groups
    stride by the tensor degree inside each stage block, pipeline groups take one rank of every data group.
    Returns (tensor groups, pipeline groups, data groups), each a list of rank lists."""
    world = tp_size * pp_size * dp_size
    print(f"\n\n*** tp={tp_size}, pp={pp_size}, dp={dp_size}, world={world}")
    tp = min(tp_size, world)
    pp = min(pp_size, world)
    dp = world // (tp * pp)
    block = world // pp
    dp_groups = [list(range(stage * block + j, (stage + 1) * block, tp)) for stage in range(pp) for j in range(tp)]
    print("DP", dp_groups)
    pp_groups = [[group[i] for group in dp_groups] for i in range(dp)]
    print("PP", pp_groups)
    tp_groups = [list(range(i * tp, (i + 1) * tp)) for i in range(world // tp)]
    print("TP", tp_groups)
    return tp_groups, pp_groups, dp_groups


def reshape(src, tgt):
    """Print how the tensor, then the pipeline, groups of ``src`` ([tp, pp, dp]) contract onto ``tgt``."""
    print(f"\n\n*** Reshaping: {src} => {tgt}")
    tp_src, pp_src, dp_src = src
    tp_tgt, pp_tgt, _ = tgt
    tp_ranks1, pp_ranks1, _ = get_mpu_ranks(tp_size=tp_src, pp_size=pp_src, dp_size=dp_src)
    tp_ranks2, pp_ranks2, _ = get_mpu_ranks(tp_size=tp_tgt, pp_size=pp_src, dp_size=dp_src)
    _, pp_ranks3, _ = get_mpu_ranks(tp_size=tp_tgt, pp_size=pp_tgt, dp_size=dp_src)
    print("\n*** TP contraction:")
    for i in range(len(tp_ranks1)):
        print(f"{tp_ranks1[i]} => {tp_ranks2[i]}")
    print("\n*** PP contraction:")
    for i in range(len(pp_ranks1)):
        print(f"{pp_ranks2[i]} => {pp_ranks3[i]}")
