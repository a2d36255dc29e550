"""The parallel plan of one ``initialize`` call: the ``ParallelDims`` every source contributes sizes to,
validated once, and the one grid built from it.

Each route into the plan contributes sizes: a ``PipelineModule`` its topology (pipe, data, model), ``mpu=``
(a shardwise grid, a registered grid view such as the compat package's ``parallel_state_sp``, or a
Megatron-style mpu) its sizes, the grid ``register_with_transformers`` laid out its sequence and tensor sizes,
the config ``tensor_parallel.autotp_size`` and ``sequence_parallel_size``, the model and the config the expert
size, the config (ZeRO++'s hpZ and qgZ) and the launcher the node size (``config_features``). Two sources
that disagree are named in the error; a combination the table refuses (``shardwise/parallel_dims.py``) is
named by ``validate()``. Then the grid is built once
(``ParallelGrid.from_dims``), laid out as the route's topology says; groups a route already needed (the
pipeline module's tensor group, the registered sequence group) are found again, not re-created. A route's
grid that already is the grid of those sizes (expert and node axes included) is used as it is.
"""

from __future__ import annotations

import os

import torch

from shardwise import comm
from shardwise.parallel_dims import ParallelDims
from shardwise.topology import ParallelGrid, active_grid, grid_of_view


def plan_grid(cfg, *, mpu=None, model=None, optimizer=None, ranks_per_node: int | None = None):
    """``(grid, dims)`` for this configuration: ``dims`` validated, ``grid`` built once from them.
    ``ranks_per_node``: the node size ZeRO++ uses without hpZ (default: the launcher's, ``zeropp_node_size``)."""
    world = comm.get_world_size()
    features = config_features(cfg, model=model, optimizer=optimizer, ranks_per_node=ranks_per_node)
    tp = max(1, cfg.tensor_parallel.autotp_size)
    sp = max(1, cfg.sequence_parallel_size)
    sizes, route_grid, megatron, source = _route(mpu, model, tp=tp, sp=sp, world=world)
    _requested(sizes, tensor=tp, sequence=sp, features=features).validate()  # a refused pair before a mismatch
    if source is not None:  # the config's sizes must be the route's
        _agree("tensor_parallel.autotp_size", tp, source, sizes.tensor)
        _agree("sequence_parallel_size", sp, source, sizes.sequence)
    dims = sizes.replace(**features).validate(world)
    grid = _build(dims, route_grid)
    if megatron is not None:
        _check_same_groups(megatron, grid)
    return grid, dims


def _route(mpu, model, *, tp: int, sp: int, world: int):
    """``(sizes, grid or None, Megatron mpu or None, source)``: the sizes the user's route gives, the grid it
    built (whose layout the plan keeps), and the source the config's sizes must agree with."""
    if _is_pipeline_module(model):
        if mpu is not None:
            raise ValueError("initialize(mpu=...) cannot be combined with a PipelineModule: its topology "
                             "defines the process groups")
        grid = model.mpu()
        return grid.dims, grid, None, None
    if mpu is not None:
        grid = mpu if isinstance(mpu, ParallelGrid) else grid_of_view(mpu)
        source = _REGISTERED if grid is not None and grid.size("sequence") > 1 else "the mpu passed to initialize()"
        sizes = grid.dims if grid is not None else megatron_sizes(mpu, world)
        return sizes, grid, (mpu if grid is None else None), source
    if sp > 1:
        grid = _registered_sequence_grid(sp)
        return grid.dims, grid, None, _REGISTERED
    if tp > 1:
        if world % tp:
            raise ValueError(f"tensor_parallel.autotp_size {tp} does not divide the world size {world}")
        sizes = ParallelDims(data=world // tp, tensor=tp)
        return sizes, _active_grid_of(sizes), None, None
    grid = _active_tensor_grid(world)
    return (grid.dims, grid, None, None) if grid is not None else (ParallelDims(data=world), None, None, None)


def _build(dims: ParallelDims, route_grid) -> ParallelGrid:
    """The engine's grid: the route's grid when it is the grid of ``dims`` (expert axis included), else built once
    from ``dims`` in the route grid's layout."""
    if route_grid is not None and route_grid.dims == dims.replace(**_NO_FEATURES) and route_grid.rank == comm.get_rank():
        return route_grid
    return ParallelGrid.from_dims(dims, topology=route_grid.topology if route_grid is not None else None)


_NO_FEATURES = {f: v for f, v in vars(ParallelDims()).items() if f not in ("data", "pipe", "tensor", "sequence",
                                                                            "expert", "node_size")}


def megatron_sizes(mpu, world: int) -> ParallelDims:
    """The sizes of a Megatron-style mpu (``get_data_parallel_world_size()`` & co.). One with sequence-parallel
    functions and no data-parallel ones (DeepSpeed's ``parallel_state_sp`` shape) has data = world / the rest."""
    def size(*names):
        for name in names:
            fn = getattr(mpu, name, None)
            if fn is not None:
                return int(fn())
        return None

    sequence = size("get_sequence_parallel_world_size") or 1
    data = size("get_data_parallel_world_size")
    if data is None and sequence == 1:
        raise ValueError(f"initialize(mpu=...): {type(mpu).__name__} has no get_data_parallel_world_size() (a "
                         "Megatron-style mpu, a shardwise grid or the grid register_with_transformers returns)")
    pipe = size("get_pipe_parallel_world_size", "get_pipeline_model_parallel_world_size") or 1
    tensor = size("get_tensor_model_parallel_world_size")
    if tensor is None:  # Megatron's older name; the sequence-only shape aliases it to the sequence size
        tensor = (size("get_model_parallel_world_size") or 1) if data is not None else 1
    if data is None:
        data = world // (pipe * tensor * sequence)
    return ParallelDims(data=data, pipe=pipe, tensor=tensor, sequence=sequence)


def _check_same_groups(mpu, grid: ParallelGrid) -> None:
    """The grid is laid out as Megatron lays ranks out (tensor fastest, then data, then pipe); a user's mpu laid
    out otherwise would have the engine reduce over other ranks than the user's code: refuse it, naming the axis."""
    import torch.distributed as dist

    for axis, name in (("data", "get_data_parallel_group"), ("model", "get_tensor_model_parallel_group")):
        fn = getattr(mpu, name, None)
        theirs = fn() if fn is not None else None
        if not isinstance(theirs, dist.ProcessGroup):
            continue
        ours = grid.group(axis)
        ours = list(range(comm.get_world_size())) if ours is None else dist.get_process_group_ranks(ours)
        if sorted(dist.get_process_group_ranks(theirs)) != sorted(ours):
            raise ValueError(f"initialize(mpu=...): the mpu's {name}() holds ranks "
                             f"{sorted(dist.get_process_group_ranks(theirs))} on rank {comm.get_rank()}, but shardwise "
                             f"lays the {axis} axis out as {sorted(ours)} (tensor ranks fastest, then data, then pipe, "
                             "as Megatron does): lay the mpu's groups out that way, or pass a shardwise grid")


def config_features(cfg, *, model=None, optimizer=None, ranks_per_node: int | None = None) -> dict:
    """What besides the sizes decides whether a grid trains: ZeRO stage, offload, the optimizer, the model; and
    the sizes the config gives: the expert size (AutoEP), the node size (ZeRO++, ``zeropp_node_size``)."""
    zero = cfg.zero_optimization
    out = {"zero_stage": int(zero.stage),
           "offload_optimizer": _offloaded(zero.offload_optimizer),
           "offload_param": int(zero.stage) == 3 and _offloaded(zero.offload_param),  # ignored below 3
           "tied_pipeline_layers": bool(getattr(model, "tied_comms", None)) if _is_pipeline_module(model) else False,
           "virtual_stages": int(getattr(model, "virtual_stages", 1)) if _is_pipeline_module(model) else 1,
           "expert": max(_expert_size(model), cfg.expert_parallel.autoep_size if cfg.expert_parallel.enabled else 1),
           "hpz_partition": int(zero.zero_hpz_partition_size) if int(zero.stage) == 3 else 1,
           "node_size": zeropp_node_size(zero, ranks_per_node=ranks_per_node)}
    out.update(optimizer_features(_optimizer_class(cfg, optimizer)))
    return out


def zeropp_node_size(zero, *, ranks_per_node: int | None = None) -> int:
    """The ranks per node of ZeRO++'s node groups, 0 when no part that needs them is on (hpZ, qgZ; stage 3):
    ``zero_hpz_partition_size`` when above 1 (hpZ's node), else ``ranks_per_node`` (``shardwise plan``'s
    ``--gpus_per_node``), else the launcher's ranks per node (``LOCAL_WORLD_SIZE``: ``shardwise run``, torchrun,
    the DeepSpeed launcher set it), else the whole world: processes started without a launcher (``mp.spawn``,
    one script) are taken to share one node, so nothing is assumed to cross nodes."""
    if int(zero.stage) != 3:
        return 0
    hpz = int(zero.zero_hpz_partition_size or 1)
    if hpz <= 1 and not zero.zero_quantized_gradients:
        return 0
    if hpz > 1:
        return hpz
    if ranks_per_node is not None:
        return int(ranks_per_node)
    local = os.environ.get("LOCAL_WORLD_SIZE", "").strip()
    if local:
        try:
            size = int(local)
        except ValueError:
            raise ValueError(f"environment variable LOCAL_WORLD_SIZE={local!r} (the launcher's ranks per node, "
                             "which ZeRO++'s zero_quantized_gradients cuts nodes by) is not an integer") from None
        if size < 1:
            raise ValueError(f"environment variable LOCAL_WORLD_SIZE={size}: the launcher's ranks per node must "
                             "be >= 1")
        return size
    return comm.get_world_size() if comm.is_initialized() else 1


def optimizer_features(optimizer_or_class) -> dict:
    if not getattr(optimizer_or_class, "compressed_communication", False):
        return {"compressed_optimizer": None, "compressed_zero1": False}
    cls = optimizer_or_class if isinstance(optimizer_or_class, type) else type(optimizer_or_class)
    return {"compressed_optimizer": cls.__name__,
            "compressed_zero1": bool(getattr(optimizer_or_class, "supports_zero1", False))}


def _optimizer_class(cfg, optimizer):
    if optimizer is not None:
        return optimizer if not callable(optimizer) or hasattr(optimizer, "step") else None
    if cfg.optimizer is None:
        return None
    from shardwise.optim.factory import optimizer_class

    return optimizer_class(cfg.optimizer.type)


def _expert_size(model) -> int:
    """The largest ``ep_size`` of the model's MoE layers: the expert axis (a sub-axis of data)."""
    if not isinstance(model, torch.nn.Module):
        return 1
    from shardwise.moe.parallel import expert_parallel_sizes

    return max(expert_parallel_sizes(model, across_stages=_is_pipeline_module(model)), default=1)


def _offloaded(block) -> bool:
    return getattr(block, "device", "none") not in (None, "none") if block is not None else False


def _is_pipeline_module(model) -> bool:
    from shardwise.pipe.module import PipelineModule

    return isinstance(model, PipelineModule)


def _requested(dims: ParallelDims, *, tensor: int, sequence: int, features: dict) -> ParallelDims:
    """The sizes the grid has, with the tensor/sequence sizes the config asks for where the grid has none:
    validating it names a refused pair (sequence with tensor, ...) before a size mismatch would."""
    return dims.replace(tensor=dims.tensor if dims.tensor > 1 else tensor,
                        sequence=dims.sequence if dims.sequence > 1 else sequence, **features)


_REGISTERED = "the groups register_with_transformers made"


def _agree(key: str, wanted: int, source: str, has: int) -> None:
    if wanted > 1 and wanted != has:
        what = "tensor size" if "autotp" in key else "sequence-parallel size"
        hint = ""
        if source == _REGISTERED and "autotp" in key:
            hint = (f": pass register_with_transformers(..., tensor_parallel_size={wanted}) (or config=, the same "
                    "config) so its groups are laid out for tensor parallelism too")
        raise ValueError(f"{'config key ' if 'sequence' in key else ''}{key} is {wanted} but {source} has {what} "
                         f"{has}{hint}")


def _registered_sequence_grid(sp: int):
    from shardwise.runtime.sequence_parallel.groups import registered_grid

    grid = registered_grid()
    if grid is None:
        raise ValueError(f"config key sequence_parallel_size is {sp} but there are no sequence-parallel groups: "
                         "call shardwise.runtime.sequence_parallel.ulysses_sp.UlyssesSPAttentionHF."
                         "register_with_transformers(...) first and pass the grid it returns to initialize(mpu=...)")
    return grid


def _active_grid_of(sizes: ParallelDims):
    """The active grid when it is laid out for exactly these sizes (its groups exist already), else None."""
    current = active_grid()
    if isinstance(current, ParallelGrid) and current.dims.replace(expert=1, node_size=0) == sizes \
            and current.topology.axes == ("pipe", "data", "model"):
        return current
    return None


def _active_tensor_grid(world: int):
    """A grid the user activated to build tensor-parallel layers on (no mpu given): the engine uses it."""
    current = active_grid()
    if current is not None and current.dims.world_size == world and current.dims.tensor > 1 \
            and current.dims.pipe == 1:
        return current
    return None
