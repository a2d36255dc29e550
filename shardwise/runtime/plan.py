"""The parallel plan of one ``initialize`` call: the ``ParallelDims`` every source asks for, validated
once, and the one grid cut from it.

The sizes come from whichever the user gave: a ``PipelineModule``'s topology, the ``mpu`` argument
(a shardwise grid, ``parallel_state_sp`` from ``register_with_transformers``, or a Megatron-style
mpu), the config (``tensor_parallel.autotp_size``, ``sequence_parallel_size``), or a grid the user
activated while building tensor-parallel layers. Two sources that disagree are named in the error;
a combination the table refuses (``shardwise/parallel_dims.py``) is named by ``validate()``.
"""

from __future__ import annotations

import torch

from shardwise import comm
from shardwise.parallel_dims import ParallelDims
from shardwise.topology import MpuGrid, ParallelGrid, active_grid


def plan_grid(cfg, *, mpu=None, model=None, optimizer=None):
    """``(grid, dims)`` for this configuration: ``dims`` validated, ``grid`` built (or the user's)."""
    world = comm.get_world_size()
    features = config_features(cfg, model=model, optimizer=optimizer)
    tp = max(1, cfg.tensor_parallel.autotp_size)
    sp = max(1, cfg.sequence_parallel_size)
    pipeline_grid = model.mpu() if _is_pipeline_module(model) else None
    if pipeline_grid is not None:
        if mpu is not None:
            raise ValueError("initialize(mpu=...) cannot be combined with a PipelineModule: its topology "
                             "defines the process groups")
        grid = pipeline_grid
        _requested(grid.dims, tensor=tp, sequence=sp, features=features).validate()
    elif mpu is not None:
        grid = _grid_of_mpu(mpu)
        _requested(grid.dims, tensor=tp, sequence=sp, features=features).validate()
        source = _REGISTERED if _is_sequence_mpu(mpu) else "the mpu passed to initialize()"
        _agree("tensor_parallel.autotp_size", tp, source, grid.dims.tensor)
        _agree("sequence_parallel_size", sp, source, grid.dims.sequence)
    elif sp > 1:
        grid = _registered_sequence_grid(sp)
        _requested(grid.dims, tensor=tp, sequence=sp, features=features).validate()
        _agree("tensor_parallel.autotp_size", tp, _REGISTERED, grid.dims.tensor)
        _agree("sequence_parallel_size", sp, _REGISTERED, grid.dims.sequence)
    elif tp > 1:
        if world % tp:
            raise ValueError(f"tensor_parallel.autotp_size {tp} does not divide the world size {world}")
        dims = ParallelDims(data=world // tp, tensor=tp, **features).validate(world)
        return _with_experts(_reuse_or_build(dims), dims), dims
    else:
        grid = _active_tensor_grid(world)
        if grid is None:
            dims = ParallelDims(data=world, **features).validate(world)
            return ParallelGrid.from_dims(dims), dims
    dims = grid.dims.replace(**features).validate(world)
    return _with_experts(grid, dims), dims


def _with_experts(grid, dims: ParallelDims):
    """A grid built before the plan knew the expert size (a PipelineModule's, the mpu's, the registered
    sequence-parallel one) gets its expert axis: a sub-axis of data, so no other group changes."""
    if dims.expert > 1 and grid.expert_size != dims.expert:
        grid.add_expert_axis(dims.expert)
    return grid


def config_features(cfg, *, model=None, optimizer=None) -> dict:
    """What besides the sizes decides whether a grid trains: ZeRO stage, offload, the optimizer, the model."""
    zero = cfg.zero_optimization
    out = {"zero_stage": int(zero.stage),
           "offload_optimizer": _offloaded(zero.offload_optimizer),
           "offload_param": int(zero.stage) == 3 and _offloaded(zero.offload_param),  # ignored below 3
           "tied_pipeline_layers": bool(getattr(model, "tied_comms", None)) if _is_pipeline_module(model) else False,
           "virtual_stages": int(getattr(model, "virtual_stages", 1)) if _is_pipeline_module(model) else 1,
           "expert": max(_expert_size(model), cfg.expert_parallel.autoep_size if cfg.expert_parallel.enabled else 1),
           "hpz_partition": int(zero.zero_hpz_partition_size) if int(zero.stage) == 3 else 1}
    out.update(optimizer_features(_optimizer_class(cfg, optimizer)))
    return out


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


def _is_sequence_mpu(mpu) -> bool:
    from shardwise.runtime.sequence_parallel import parallel_state_sp

    return mpu is parallel_state_sp


def _grid_of_mpu(mpu):
    if isinstance(mpu, (ParallelGrid, MpuGrid)):
        return mpu
    from shardwise.runtime.sequence_parallel import parallel_state_sp

    if mpu is parallel_state_sp:
        return parallel_state_sp.get_grid()
    return MpuGrid(mpu)


def _registered_sequence_grid(sp: int):
    from shardwise.runtime.sequence_parallel import parallel_state_sp

    if not parallel_state_sp.is_initialized():
        raise ValueError(f"config key sequence_parallel_size is {sp} but there are no sequence-parallel groups: "
                         "call shardwise.runtime.sequence_parallel.ulysses_sp.UlyssesSPAttentionHF."
                         "register_with_transformers(...) first and pass the mpu it returns to initialize(mpu=...)")
    return parallel_state_sp.get_grid()


def _reuse_or_build(dims: ParallelDims) -> ParallelGrid:
    current = active_grid()
    if isinstance(current, ParallelGrid) and current.dims == ParallelDims(data=dims.data, tensor=dims.tensor) \
            and current.topology.axes == ("pipe", "data", "model"):
        return current
    return ParallelGrid.from_dims(dims)


def _active_tensor_grid(world: int):
    """A grid the user activated to build tensor-parallel layers on (no mpu given): the engine uses it."""
    current = active_grid()
    if current is not None and current.dims.world_size == world and current.dims.tensor > 1 \
            and current.dims.pipe == 1:
        return current
    return None
