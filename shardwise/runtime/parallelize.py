"""The assembly line of a training engine: every part ``Engine`` and ``PipelineEngine`` hold, built in
one fixed order by ``parallelize``.

Each step reads only what the steps before it built, so the order is the dependency order:

1. **Layout**: sizes, groups and ranks from the grid (the one source of sizes), the batch sizes, and the
   ``ParallelDims`` the ZeRO strategy reads (the grid's sizes with the config's features).
2. **AutoEP**, then **AutoTP**: they replace or cut the model's layers, so they come before anything reads
   its parameters (AutoEP's blocks are ordinary layers to AutoTP).
3. **Model placement and its groups**: the model onto the device; the expert groups (collective: every rank
   creates them in the same order; a pipeline creates every stage's); the tensor-sequence gradient hooks.
4. **Precision**: the precision policy and autocast marks, before the weights are broadcast and cast.
5. **Start weights**: data-parallel rank 0's weights and buffers to every replica (each expert from the
   first rank of its expert-data group), then frozen parameters and buffers to their training dtype.
6. **Optimizer**: over the model's parameters as they are now (on the device, AutoTP's shards).
7. **ZeRO strategy**: takes the optimizer's parameters over (master weights, flat buffers, partitions);
   ZeRO-3 leaf modules are marked first, as they decide the gather units.
8. **Scheduler and loss scaler**: the scheduler wraps the optimizer; the scaler is handed to the strategy
   for ``safe_get_full_grad``.
9. **Data loader**: needs the batch sizes and the data-parallel rank (curriculum sampling reads the engine).
10. **Training step**: strategy, scaler, scheduler and batch sizes in the one object that counts and steps.
11. **Activation checkpointing**: the ``activation_checkpointing`` block configured over the grid.
12. **Observer**: monitors, flops profiler and autotuning read the engine's training state, now complete.
13. **Compile**: last, because ZeRO-3's compiled blocks keep the strategy's gather hooks outside the
    compiled graphs (the strategy must exist), and compiling changes nothing the steps above read.

docs/engine.md ("Assembly") has the same list.
"""

from __future__ import annotations

import torch

from shardwise import checkpointing, comm
from shardwise.monitor.observer import StepObserver
from shardwise.parallel_dims import ParallelDims, check_rule
from shardwise.precision import PrecisionPolicy, create_loss_scaler
from shardwise.runtime import autocast as torch_autocast
from shardwise.runtime.engine_compat import check_forced_cpu_optimizer
from shardwise.runtime.module_dtypes import cast_buffers, cast_parameters, keep_in_fp32_pattern
from shardwise.runtime.plan import config_features, optimizer_features
from shardwise.runtime.timers import Timers
from shardwise.runtime.train_step import TrainingStep
from shardwise.zero import ReduceSettings, build_strategy, is_partitioned
from shardwise.zero import registry as zero_registry

__all__ = ["parallelize"]

_COMM_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def parallelize(engine, model: torch.nn.Module, *, pipeline: bool = False, optimizer=None, model_parameters=None,
                lr_scheduler=None, training_data=None, collate_fn=None) -> None:
    """Build ``engine``'s parts around ``model`` in the order of the module docstring. ``engine.config`` and
    ``engine.grid`` are set; ``pipeline``: the model is a ``PipelineModule`` (its tied duplicates are left
    out of the norm; AutoTP does not apply)."""
    config, grid = engine.config, engine.grid
    _layout(engine, model)                                                          # 1
    if config.expert_parallel.enabled:                                              # 2: AutoEP
        from shardwise.moe.autoep import apply_autoep

        model, model_parameters = apply_autoep(model, config.expert_parallel, optimizer=optimizer,
                                               model_parameters=model_parameters)
    if not pipeline and config.tensor_parallel.autotp_size > 1:                     # 2: AutoTP
        from shardwise.tensor_parallel import autotp_hook

        model = autotp_hook(model, grid)
    _place_model(engine, model)                                                     # 3
    engine.precision = PrecisionPolicy.from_config(config)                          # 4
    engine._autocast_dtype = _autocast(engine)
    _broadcast_model(engine)                                                        # 5
    _cast_module(engine)
    engine.optimizer = _optimizer(engine, optimizer, model_parameters)              # 6
    engine.strategy = _strategy(engine)                                             # 7
    scheduler = _scheduler(engine, lr_scheduler)                                    # 8
    engine._publish_overflow(False)
    engine.loss_scaler = create_loss_scaler(config.fp16) if engine.precision.loss_scaling else None
    zero_registry.set_loss_scaler(engine.strategy, engine.loss_scaler)  # for shardwise.utils.safe_get_full_grad
    engine.training_dataloader = None                                               # 9
    if training_data is not None:
        engine.training_dataloader = engine.deepspeed_io(training_data, collate_fn=collate_fn)
    from shardwise.moe.autoep.block import balancing_blocks

    norm_skip = frozenset(engine.module.tied_duplicate_names()) if pipeline else frozenset()
    engine.train_step = TrainingStep(                                               # 10
        strategy=engine.strategy, loss_scaler=engine.loss_scaler, lr_scheduler=scheduler,
        batch=engine._batch,
        grid=grid, module=engine.module, norm_skip=norm_skip, device=engine.device,
        after_update=[b.move_bias for b in balancing_blocks(engine.module)],  # AutoEP's loss-free balancing
        clip=float(config.gradient_clipping or 0.0), check_overflow=engine.precision.check_overflow)
    engine.timers = Timers(engine.device, enabled=bool(config.wall_clock_breakdown))
    _check_partitioned_activations(config, engine.module, engine.tp_world_size)   # 11
    checkpointing.configure_from(config, mpu=grid)  # activation_checkpointing block, if set
    engine.observer = StepObserver(engine.training_state(), autotuning_engine=engine)  # 12
    engine.monitor = engine.observer.monitor
    if config.compile.enabled:  # ours: the compile block compiles at initialize      # 13
        engine.compile(backend=config.compile.backend, compile_kwargs=config.compile.kwargs)


# -- 1. layout ------------------------------------------------------------------------------------------
def _layout(engine, model) -> None:
    """Sizes, groups and ranks from the grid. Batch arithmetic counts data-parallel replicas (world /
    sequence size); ZeRO shards and reduces over every data x sequence rank, DeepSpeed's
    sequence-data-parallel group, averaging over all of them (docs/sequence-parallel.md says why that
    gives one process's gradient)."""
    config, grid = engine.config, engine.grid
    engine.sequence_parallel_size = grid.size("sequence")
    engine.dp_world_size = grid.size("data")
    engine.tp_world_size = grid.size("model")
    if engine.sequence_parallel_size > 1:
        engine.dp_group = grid.get_sequence_data_parallel_group()
        engine.seq_dp_world_size = grid.get_sequence_data_parallel_world_size()
    else:
        engine.dp_group = grid.get_data_parallel_group()
        engine.seq_dp_world_size = engine.dp_world_size
    engine.global_rank = comm.get_rank()
    engine.world_size = comm.get_world_size()
    engine.local_rank = comm.get_local_rank()
    engine.device = comm.get_accelerator_device(engine.local_rank)
    engine._batch = config.resolve_batch_sizes(engine.dp_world_size)
    config.check_supported()
    # the grid's sizes with what else decides the layout (ZeRO stage, offload, optimizer, experts)
    engine.dims = grid.dims.replace(**config_features(config, model=model)).validate(engine.world_size)


# -- 3. model placement and its groups ------------------------------------------------------------------
def _place_model(engine, model) -> None:
    from shardwise.moe import parallel as moe_parallel
    from shardwise.moe.utils import has_moe_layers
    from shardwise.runtime.tp_sequence_grads import sync_sequence_parallel_grads

    _check_tensor_parallel_layers(model, engine.tp_world_size)
    engine.module = model.to(engine.device)
    engine.has_moe_layers, engine.num_experts = has_moe_layers(engine.module)
    pipe = engine.dims.pipe > 1
    if engine.has_moe_layers or pipe:  # the expert groups, before the experts' start weights are broadcast
        with engine.grid.active():  # (a pipeline: on every stage, whether it has MoE layers or not)
            moe_parallel.configure(engine.module, across_stages=pipe)
    if engine.tp_world_size > 1:  # norms/biases on sequence shards: sum their gradients over the tensor ranks
        sync_sequence_parallel_grads(engine.module, engine.grid.get_tensor_model_parallel_group())


def _check_tensor_parallel_layers(model: torch.nn.Module, tp: int) -> None:
    """Tensor-parallel layers cut themselves over the grid active when they are built: one built
    outside the grid's scope (or for another grid) holds the wrong pieces."""
    from shardwise.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding

    for name, m in model.named_modules():
        if isinstance(m, (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding)) and m.world_size != tp:
            raise ValueError(f"layer '{name}' ({type(m).__name__}) was built for tensor size {m.world_size} but the "
                             f"engine's grid has tensor size {tp}: build the model inside `with grid.active():` "
                             "and pass initialize(mpu=grid) the grid it was built on")


# -- 4. precision ---------------------------------------------------------------------------------------
def _autocast(engine) -> torch.dtype | None:
    """``torch_autocast``: the dtype the forward autocasts to (None when the block is off)."""
    block = engine.config.torch_autocast
    if not block.enabled:
        return None
    dtype = torch_autocast.DTYPES[block.dtype]
    torch_autocast.mark_lower_precision_params(engine.module, dtype, block.lower_precision_safe_modules)
    return dtype


# -- 5. start weights -----------------------------------------------------------------------------------
def _broadcast_model(engine) -> None:
    """Every data-parallel replica starts from data-parallel rank 0's weights and buffers
    (parameters ``zero.Init`` partitioned were broadcast when they were sharded)."""
    from shardwise.moe import parallel as moe_parallel
    from shardwise.moe.utils import is_moe_param

    if engine.seq_dp_world_size == 1:
        return
    group = engine.dp_group
    src = 0 if group is None else torch.distributed.get_global_rank(group, 0)
    params = [p for p in engine.module.parameters() if not is_partitioned(p) and not is_moe_param(p)]
    with torch.no_grad():
        for t in params + list(engine.module.buffers()):
            comm.broadcast(t.data, src=src, group=group)
    if engine.has_moe_layers:  # each expert from the first rank of its expert-data-parallel group
        moe_parallel.broadcast_experts(engine.module)


def _cast_module(engine) -> None:
    """Frozen parameters to the training dtype (the strategy casts the trainable ones); buffers keep
    their dtype unless ``data_types.buffer_dtype`` is set (runtime/module_dtypes.py)."""
    dtype = engine.precision.param_dtype
    keep = keep_in_fp32_pattern(engine.module, engine.config.data_types.keep_in_fp32_modules, dtype)
    cast_buffers(engine.module, engine.precision.buffer_dtype, keep_fp32=keep)
    if dtype != torch.float32:
        cast_parameters((p for p in engine.module.parameters() if not p.requires_grad), dtype)


# -- 6. optimizer ---------------------------------------------------------------------------------------
def _check_muon(config) -> None:
    zc = config.zero_optimization
    offloaded = zc.stage > 0 and zc.offload_optimizer is not None and zc.offload_optimizer.device != "none"
    check_rule("muon_offload", ParallelDims(zero_stage=zc.stage, muon=True, offload_optimizer=offloaded))


def _optimizer(engine, client_optimizer, model_parameters):
    config = engine.config
    cfg_opt = config.optimizer
    if client_optimizer is not None and cfg_opt is not None:
        raise ValueError("both an optimizer passed to initialize() and an 'optimizer' block in the config: "
                         "remove one of them")
    params = model_parameters if model_parameters is not None else engine.module.parameters()
    if client_optimizer is not None:
        if isinstance(client_optimizer, torch.optim.Optimizer):
            return check_forced_cpu_optimizer(config, client_optimizer)
        if callable(client_optimizer):
            return check_forced_cpu_optimizer(config, client_optimizer(params))
        raise ValueError(f"optimizer must be a torch.optim.Optimizer or a callable, got {type(client_optimizer)!r}")
    if cfg_opt is None:
        return None
    from shardwise.optim import build_optimizer

    if cfg_opt.type.lower() == "muon":
        _check_muon(config)
        from shardwise.optim.muon import tag_muon_params
        tag_muon_params(engine.module)  # DeepSpeed's split, where the user set no p.use_muon
    return build_optimizer(cfg_opt.type, dict(cfg_opt.params or {}), params)


# -- 7. ZeRO strategy -----------------------------------------------------------------------------------
def _strategy(engine):
    """The ZeRO strategy over the data (x sequence) group; with MoE layers, expert parameters reduce over
    their expert-data-parallel group."""
    import functools

    from shardwise.moe import parallel as moe_parallel
    from shardwise.utils.z3_leaf_module import apply_leaf_module_config

    config, optimizer = engine.config, engine.optimizer
    if engine.dims.compressed_optimizer is None and getattr(optimizer, "compressed_communication", False):
        engine.dims = engine.dims.replace(**optimizer_features(optimizer)).validate()
    zero = config.zero_optimization
    build = functools.partial(build_strategy, zero, aio=config.aio, module=engine.module,
                              precision=engine.precision, dims=engine.dims, reduce=_reduce_settings(engine))
    named_params = list(engine.module.named_parameters())
    if int(zero.stage) == 3:  # MoE blocks that run only their tokens' experts: gathered whole
        apply_leaf_module_config(engine.module, zero.leaf_module)
    layout = None
    if engine.has_moe_layers:  # experts reduce (and are partitioned) over their expert-data-parallel group
        layout = moe_parallel.expert_layout(engine.module, dp_group=engine.dp_group, optimizer=optimizer,
                                            zero_stage=int(zero.stage))
    return build(named_params=named_params, optimizer=optimizer, dp_group=engine.dp_group, layout=layout)


def _reduce_settings(engine) -> ReduceSettings:
    c = engine.config
    # as DeepSpeed: under sequence parallelism gradients are reduced in seq_parallel_communication_data_type
    key = c.seq_parallel_communication_data_type if engine.sequence_parallel_size > 1 else c.communication_data_type
    return ReduceSettings(
        bucket_elements=int(c.zero_optimization.reduce_bucket_size),
        bucket_size_given="reduce_bucket_size" in c.zero_optimization.model_fields_set,
        average=c.gradient_allreduce_op == "mean",
        prescale=bool(c.prescale_gradients),
        predivide_factor=float(c.gradient_predivide_factor),
        comm_dtype=_COMM_DTYPES[key] if key else None,
    )


# -- 8. scheduler ---------------------------------------------------------------------------------------
def _scheduler(engine, client_scheduler):
    cfg_sched = engine.config.scheduler
    if client_scheduler is not None and cfg_sched is not None:
        raise ValueError("both an lr_scheduler passed to initialize() and a 'scheduler' block in the config: "
                         "remove one of them")
    if client_scheduler is not None:
        if callable(client_scheduler) and not hasattr(client_scheduler, "step"):
            return client_scheduler(engine.optimizer)
        return client_scheduler
    if cfg_sched is None:
        return None
    if engine.optimizer is None:
        raise ValueError("a 'scheduler' block needs an optimizer (config 'optimizer' or initialize(optimizer=...))")
    from shardwise.optim import build_scheduler

    return build_scheduler(cfg_sched.type, dict(cfg_sched.params or {}), engine.optimizer)


# -- 11. activation checkpointing -----------------------------------------------------------------------
def _check_partitioned_activations(config, module: torch.nn.Module, tp: int) -> None:
    """partition_activations cuts each checkpointed input over the tensor ranks as if they all held the same
    one; under Megatron's sequence parallelism they hold different sequence slices (trains wrong: refused)."""
    block = config.activation_checkpointing
    if tp > 1 and block is not None and block.partition_activations:
        marked = any(getattr(p, "sequence_parallel", False) for p in module.parameters())
        check_rule("partition_activations_sequence_parallel",
                   ParallelDims(tensor=tp, partition_activations=True, sequence_parallel_params=marked))
