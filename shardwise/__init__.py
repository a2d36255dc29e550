"""shardwise: DeepSpeed-compatible distributed training for PyTorch.

``import shardwise as deepspeed`` and keep your training script.
"""

from __future__ import annotations

import argparse
import logging

from shardwise.version import __version__  # noqa: E402

from shardwise import comm  # noqa: E402  (light: torch only)
from shardwise._unsupported import install_finder  # noqa: E402
from shardwise.accelerator import get_accelerator  # noqa: E402
from shardwise.comm import init_distributed  # noqa: E402
from shardwise.utils.logging import log_dist, logger  # noqa: E402

install_finder()  # `import shardwise.inference.v2` (and other DeepSpeed paths not built) names the path and says so

__all__ = ["__version__", "add_config_arguments", "comm", "get_accelerator", "init_distributed", "initialize",
           "log_dist", "logger"]


class MissingModelError(ValueError, AssertionError):
    """``initialize()`` without a model: a ValueError (a user mistake) that is also the AssertionError
    DeepSpeed raises there."""


def initialize(
    args=None,
    model=None,
    optimizer=None,
    model_parameters=None,
    training_data=None,
    lr_scheduler=None,
    mpu=None,
    dist_init_required=None,
    collate_fn=None,
    config=None,
    config_params=None,
    *,
    engine_classes=None,
):
    """Wrap ``model`` for distributed training.

    Returns ``(engine, optimizer, training_dataloader, lr_scheduler)`` exactly like
    ``deepspeed.initialize``.  The config comes from ``config`` (a path or a dict),
    ``config_params`` (a dict, DeepSpeed's older name), or ``args.deepspeed_config``.
    ``engine_classes``: subclasses to build instead of shardwise's, keyed ``"engine"`` (``Engine``),
    ``"pipeline"`` (``PipelineEngine``) and ``"hybrid"`` (``HybridEngine``); the ``deepspeed``
    compatibility package passes its ``DeepSpeedEngine`` family.
    """
    from shardwise.config import load_config
    from shardwise.runtime.engine import Engine

    if model is None:
        hint = " (a model given first is taken as args: pass model=...)" if hasattr(args, "parameters") else ""
        raise MissingModelError("initialize() needs model=..." + hint)
    source = _config_source(args, config, config_params)
    cfg = load_config(source)
    from shardwise.tensor_parallel.autotp import merge_tp_model_init

    cfg = merge_tp_model_init(cfg)  # a tp_model_init() call before initialize() sets tensor_parallel
    init_distributed(dist_init_required=dist_init_required)
    cfg = _client_objects_win(cfg, optimizer, lr_scheduler)
    comm.configure(comms_logger=cfg.comms_logger, timeout=cfg.comm_timeout)
    from shardwise.pipe.module import PipelineModule
    from shardwise.runtime.plan import plan_grid

    if not isinstance(model, PipelineModule) and cfg.pipeline != type(cfg.pipeline)():
        raise ValueError("the config has a 'pipeline' block but the model is not a shardwise.pipe.PipelineModule "
                         f"({type(model).__name__}); pipeline parallelism needs one (and one process per stage), "
                         "else remove the block")
    if cfg.expert_parallel.enabled:  # AutoEP: the blocks and sizes checked before any group exists
        from shardwise.moe.autoep import check_sizes

        data = comm.get_world_size() // max(1, cfg.tensor_parallel.autotp_size)  # (x sequence: each rank's tokens)
        check_sizes(model, cfg.expert_parallel, data_size=data)
    grid, _ = plan_grid(cfg, mpu=mpu, model=model, optimizer=optimizer)  # every size, validated once
    grid.activate()  # DeepSpeed's group accessors (deepspeed.utils.groups, mpu views) answer from the engine's grid
    parts = dict(model=model, config=cfg, grid=grid, optimizer=optimizer, model_parameters=model_parameters,
                 lr_scheduler=lr_scheduler, training_data=training_data, collate_fn=collate_fn)
    if isinstance(model, PipelineModule):  # (AutoEP and AutoTP: runtime/parallelize.py)
        from shardwise.pipe.engine import PipelineEngine

        engine = _engine_class(engine_classes, "pipeline", PipelineEngine)(**parts)
        return engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler
    engine_class = _engine_class(engine_classes, "engine", Engine)
    if cfg.hybrid_engine.enabled:  # an RLHF actor: trains, and generates with whole weights
        from shardwise.runtime.hybrid_engine import HybridEngine

        engine_class = _engine_class(engine_classes, "hybrid", HybridEngine)
    engine = engine_class(**parts)
    engine.client_optimizer = optimizer
    engine.client_lr_scheduler = lr_scheduler
    return engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler


def _engine_class(classes, kind: str, default):
    chosen = (classes or {}).get(kind, default)
    if not (isinstance(chosen, type) and issubclass(chosen, default)):
        raise TypeError(f"initialize(engine_classes={{'{kind}': {chosen!r}}}): expected a subclass of "
                        f"{default.__module__}.{default.__name__}")
    return chosen


def _client_objects_win(cfg, optimizer, lr_scheduler):
    """An optimizer (scheduler) passed to initialize() is used even when the config has an
    ``optimizer`` (``scheduler``) block, as in DeepSpeed; rank 0 logs which one won, once."""
    dropped = {}
    if optimizer is not None and cfg.optimizer is not None:
        dropped["optimizer"] = None
        log_dist(f"Using the client optimizer ({_kind(optimizer)}) passed to initialize(); the config's "
                 f"'optimizer' block (type {cfg.optimizer.type}) is not used", ranks=[0], level=logging.WARNING)
    if lr_scheduler is not None and cfg.scheduler is not None:
        dropped["scheduler"] = None
        log_dist(f"Using the client LR scheduler ({_kind(lr_scheduler)}) passed to initialize(); the config's "
                 f"'scheduler' block (type {cfg.scheduler.type}) is not used", ranks=[0], level=logging.WARNING)
    return cfg.model_copy(update=dropped) if dropped else cfg


def _kind(obj) -> str:
    return getattr(obj, "__name__", None) or type(obj).__name__


def _config_source(args, config, config_params):
    from_args = None
    if args is not None:
        for attr in ("deepspeed_config", "shardwise_config"):
            if getattr(args, attr, None):
                from_args = getattr(args, attr)
        if from_args is None and getattr(args, "deepscale_config", None):
            from_args = args.deepscale_config
    given = [(n, v) for n, v in (("config", config), ("config_params", config_params), ("args.deepspeed_config", from_args)) if v is not None]
    if not given:
        raise ValueError(
            "no config: pass initialize(config=<path or dict>) or launch with --deepspeed_config ds_config.json"
        )
    if len(given) > 1:
        raise ValueError(
            "the config was given more than once (" + ", ".join(n for n, _ in given) + "): keep exactly one"
        )
    return given[0][1]


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add ``--deepspeed``/``--deepspeed_config`` (and ``--shardwise``/``--shardwise_config``) to ``parser``."""
    group = parser.add_argument_group("shardwise", "shardwise / DeepSpeed configuration")
    group.add_argument("--deepspeed", "--shardwise", dest="deepspeed", default=False, action="store_true",
                       help="enable shardwise (DeepSpeed-compatible flag)")
    group.add_argument("--deepspeed_config", "--shardwise_config", dest="deepspeed_config", default=None, type=str,
                       help="path to a DeepSpeed-format JSON config")
    return parser


_LAZY = {
    "RepeatingLoader": ("shardwise.runtime.dataloader", "RepeatingLoader"),
    "Engine": ("shardwise.runtime.engine", "Engine"),
    "DeepSpeedEngine": ("shardwise.runtime.engine", "Engine"),
    "DeepSpeedHybridEngine": ("shardwise.runtime.hybrid_engine", "HybridEngine"),
    "DeepSpeedConfigError": ("shardwise.config", "ConfigError"),
    "OnDevice": ("shardwise.utils.init_on_device", "OnDevice"),
    "accelerator": ("shardwise.accelerator", None),
    "utils": ("shardwise.utils", None),
    "elasticity": ("shardwise.elasticity", None),
    "PipelineEngine": ("shardwise.pipe.engine", "PipelineEngine"),
    "PipelineModule": ("shardwise.pipe.module", "PipelineModule"),
    "pipe": ("shardwise.pipe", None),
    "zero": ("shardwise.zero", None),
    "runtime": ("shardwise.runtime", None),
    "checkpoint": ("shardwise.checkpoint", None),
    "tensor_parallel": ("shardwise.tensor_parallel", None),
    "models": ("shardwise.models", None),
    "checkpointing": ("shardwise.checkpointing", None),  # activation checkpointing (deepspeed.checkpointing)
    "profiling": ("shardwise.profiling", None),
    "monitor": ("shardwise.monitor", None),
    "init_inference": ("shardwise.inference", "init_inference"),
    "InferenceEngine": ("shardwise.inference", "InferenceEngine"),
    "inference": ("shardwise.inference", None),
    "tp_model_init": ("shardwise.tensor_parallel.autotp", "tp_model_init"),
}


def __getattr__(name: str):
    """Heavier pieces load on first use so ``import shardwise`` stays light."""
    if name not in _LAZY:
        from shardwise._unsupported import unsupported_attribute

        raise unsupported_attribute(name)
    import importlib

    module_name, attr = _LAZY[name]
    module = importlib.import_module(module_name)
    return module if attr is None else getattr(module, attr)
