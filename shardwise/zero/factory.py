"""The one place that maps ``zero_optimization.stage`` to a strategy class."""

from __future__ import annotations

from shardwise.parallel_dims import ParallelDims
from shardwise.zero.compressed import CompressedDataParallelStrategy, CompressedStage1Strategy
from shardwise.zero.partitioned_step import offload_device
from shardwise.zero.stage0 import DataParallelStrategy
from shardwise.zero.stage3 import Stage3Strategy
from shardwise.zero.stage12 import Stage1Strategy, Stage2Strategy
from shardwise.zero.strategy import ZeroStrategy


def build_strategy(zero_config, *, aio=None, module, optimizer, dp_group=None, dims: ParallelDims | None = None,
                   **kwargs) -> ZeroStrategy:
    """The strategy for ``zero_config.stage`` (a ``zero_optimization`` config block), reducing over
    ``dp_group`` (the data-parallel process group; ``None``: every rank). An optimizer with
    ``compressed_communication`` (1-bit Adam & co) gets the compressed variant of stage 0 or 1
    (``zero/compressed.py``). ``dims``: the engine's validated ``ParallelDims``; without it the
    combination of stage, offload and optimizer is checked against the same table here. ``layout``
    (``zero/layout.py``, optional): which group each parameter reduces over (MoE experts: their own)."""
    stage = int(zero_config.stage)
    compressed = bool(getattr(optimizer, "compressed_communication", False))
    if dims is None:
        dims = ParallelDims(zero_stage=stage, offload_optimizer=offload_device(zero_config.offload_optimizer) != "none",
                            offload_param=stage == 3 and offload_device(zero_config.offload_param) != "none",
                            compressed_optimizer=type(optimizer).__name__ if compressed else None,
                            compressed_zero1=bool(getattr(optimizer, "supports_zero1", False))).validate()
    if stage == 0:
        cls = CompressedDataParallelStrategy if compressed else DataParallelStrategy
        return cls(optimizer=optimizer, dp_group=dp_group, **kwargs)
    if stage in (1, 2):
        cls = Stage2Strategy if stage == 2 else CompressedStage1Strategy if compressed else Stage1Strategy
        return cls(
            allgather_bucket_elements=int(zero_config.allgather_bucket_size),
            use_reduce_scatter=bool(zero_config.reduce_scatter),
            offload_optimizer=zero_config.offload_optimizer,
            sub_group_size=int(zero_config.sub_group_size),
            ignore_unused_parameters=bool(zero_config.ignore_unused_parameters),
            aio=aio,
            optimizer=optimizer,
            dp_group=dp_group,
            **kwargs,
        )
    if stage == 3:
        layout = kwargs.get("layout")
        if layout is not None:  # (fragments and checkpoints name each expert by its global index)
            kwargs["named_params"] = layout.named(kwargs["named_params"])
        return Stage3Strategy(module=module, zero_config=zero_config, aio=aio, optimizer=optimizer, dp_group=dp_group,
                              **kwargs)
    raise ValueError(f"not implemented yet: zero_optimization.stage={stage}")
