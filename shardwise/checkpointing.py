"""Activation checkpointing: DeepSpeed's ``deepspeed.checkpointing`` API on ``torch.utils.checkpoint``.

    from shardwise import checkpointing
    h = checkpointing.checkpoint(block, h)          # block's activations are recomputed in backward

``checkpoint`` runs ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``: only the
function's inputs are kept; everything it computes is recomputed when backward reaches it.
The ``activation_checkpointing`` config block (applied by ``initialize``, or by ``configure``)
adds, as in DeepSpeed:

* ``partition_activations``: each model-parallel rank keeps only its 1/mp slice of the saved
  inputs; they are all-gathered again just before recomputation (no effect with mp size 1);
* ``cpu_checkpointing``: the saved inputs (or slices) are kept in host memory;
* ``synchronize_checkpoint_boundary``: synchronize the accelerator around each call;
* ``profile``: log the forward and recomputation time of every call (rank 0).

``contiguous_memory_optimization`` (and ``number_checkpoints``, which only sizes its buffer)
is not implemented.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from dataclasses import dataclass

import torch
import torch.utils.checkpoint as torch_checkpoint

from shardwise import comm
from shardwise.tensor_parallel import random as _random
from shardwise.tensor_parallel.random import (_CUDA_RNG_STATE_TRACKER, _MODEL_PARALLEL_RNG_TRACKER_NAME,  # noqa: F401
                                              CudaRNGStatesTracker, _set_cuda_rng_state, get_cuda_rng_tracker,
                                              model_parallel_reconfigure_tp_seed)

__all__ = ["checkpoint", "non_reentrant_checkpoint", "configure", "configure_from", "is_configured", "reset",
           "get_settings", "get_profile", "get_cuda_rng_tracker", "model_parallel_cuda_manual_seed",
           "model_parallel_reconfigure_tp_seed", "CudaRNGStatesTracker"]

logger = logging.getLogger("shardwise")


@dataclass
class Settings:
    partition_activations: bool = False
    cpu_checkpointing: bool = False
    number_checkpoints: int | None = None
    synchronize: bool = False
    profile: bool = False
    mp_group: object = None
    mp_size: int = 1
    mp_rank: int = 0
    mpu_given: bool = False  # configure(mpu_): model-parallel seeding asks it (mp_rank), as DeepSpeed's does


_settings = Settings()
_configured = False
_COPY_CPU_TENSORS = False  # tests: make cpu_checkpointing copy host tensors too (a CPU-only machine)
_profile = {"calls": 0, "forward_ms": 0.0, "recompute_ms": 0.0, "kept_bytes": 0}


def get_settings() -> Settings:
    return _settings


def get_profile() -> dict:
    """Totals since ``configure``/``reset``: ``kept_bytes`` of saved inputs held as slices or on the
    host; with ``profile`` also calls, forward_ms, recompute_ms."""
    return dict(_profile)


def is_configured() -> bool:
    """True once ``configure`` (or ``initialize`` with an ``activation_checkpointing`` block) ran."""
    return _configured


def reset() -> None:
    """Forget timing totals (DeepSpeed uses this to drop contiguous buffers; we have none)."""
    _profile.update(calls=0, forward_ms=0.0, recompute_ms=0.0, kept_bytes=0)


def _model_parallel(mpu):
    """(group, size, rank) of the model-parallel axis of ``mpu`` (a Megatron mpu or a shardwise grid)."""
    if mpu is None:
        return None, 1, 0
    if hasattr(mpu, "group") and hasattr(mpu, "axis_rank"):  # shardwise.topology.ParallelGrid
        size = mpu.size("model")
        return (mpu.group("model") if size > 1 else None), size, mpu.axis_rank("model")
    for prefix in ("get_tensor_model_parallel", "get_model_parallel"):
        if hasattr(mpu, f"{prefix}_world_size"):
            size = int(getattr(mpu, f"{prefix}_world_size")())
            rank = int(getattr(mpu, f"{prefix}_rank")())
            group = getattr(mpu, f"{prefix}_group")() if size > 1 else None
            return group, size, rank
    raise ValueError(f"checkpointing.configure: {type(mpu).__name__} has no get_model_parallel_world_size()")


def configure(mpu_=None, deepspeed_config=None, partition_activations=None, contiguous_checkpointing=None,
              num_checkpoints=None, checkpoint_in_cpu=None, synchronize=None, profile=None) -> None:
    """Set the options (DeepSpeed's signature). Explicit arguments override ``deepspeed_config``
    (a path, a dict or a loaded config); unset options take the block's defaults."""
    global _settings, _configured
    block = None
    if deepspeed_config is not None:
        from shardwise.config import ShardwiseConfig, load_config

        cfg = deepspeed_config if isinstance(deepspeed_config, ShardwiseConfig) else load_config(deepspeed_config)
        block = cfg.activation_checkpointing
    s = Settings()
    if block is not None:
        s.partition_activations = block.partition_activations
        s.cpu_checkpointing = block.cpu_checkpointing
        s.number_checkpoints = block.number_checkpoints
        s.synchronize = block.synchronize_checkpoint_boundary
        s.profile = block.profile
        contiguous = block.contiguous_memory_optimization
    else:
        contiguous = False
    if contiguous_checkpointing is not None:
        contiguous = contiguous_checkpointing
    for name, value in (("partition_activations", partition_activations), ("cpu_checkpointing", checkpoint_in_cpu),
                        ("number_checkpoints", num_checkpoints), ("synchronize", synchronize), ("profile", profile)):
        if value is not None:
            setattr(s, name, value)
    if contiguous:  # with partitioned activations DeepSpeed first asks for the layer count (its AssertionError)
        assert not s.partition_activations or s.number_checkpoints is not None, (
            "Must specify the number of layers with contiguous memory checkpointing "
            "(activation_checkpointing.number_checkpoints)")
        raise ValueError("not implemented yet: activation_checkpointing.contiguous_memory_optimization "
                         "(contiguous_checkpointing)")
    s.mp_group, s.mp_size, s.mp_rank = _model_parallel(mpu_)
    s.mpu_given = mpu_ is not None  # as in DeepSpeed, the mpu given here is the one model-parallel seeding asks
    _settings, _configured = s, True
    reset()
    if comm.get_rank() == 0:
        logger.info("activation checkpointing: partition_activations=%s (model-parallel size %d), "
                    "cpu_checkpointing=%s, synchronize=%s, profile=%s", s.partition_activations, s.mp_size,
                    s.cpu_checkpointing, s.synchronize, s.profile)


def model_parallel_cuda_manual_seed(seed: int, tp_rank: int | None = None) -> None:
    """``shardwise.tensor_parallel.model_parallel_cuda_manual_seed`` at the tensor rank of the mpu given to
    ``configure`` (DeepSpeed's ``checkpointing.model_parallel_cuda_manual_seed`` asks that mpu), else of the
    active grid, unless ``tp_rank`` is given."""
    if tp_rank is None and _configured and _settings.mpu_given:
        tp_rank = _settings.mp_rank
    _random.model_parallel_cuda_manual_seed(seed, tp_rank)


def configure_from(config, mpu=None) -> None:
    """Apply a loaded config's ``activation_checkpointing`` block if it differs from the defaults."""
    block = config.activation_checkpointing
    if block != type(block)():
        configure(mpu, deepspeed_config=config)


# -- saved-input hooks: partition across model-parallel ranks and/or keep on the host ----------
def _pack(t: torch.Tensor):
    s = _settings
    if s.partition_activations and s.mp_size > 1 and t.is_floating_point() and t.numel() >= s.mp_size:
        flat = t.detach().reshape(-1)
        chunk = math.ceil(flat.numel() / s.mp_size)
        piece = flat[s.mp_rank * chunk:(s.mp_rank + 1) * chunk]
        shard = torch.zeros(chunk, dtype=t.dtype, device="cpu" if s.cpu_checkpointing else t.device)
        shard[:piece.numel()].copy_(piece)
        _profile["kept_bytes"] += shard.nbytes
        return ("slice", shard, t.shape, t.device, chunk)
    if s.cpu_checkpointing and (t.device.type != "cpu" or _COPY_CPU_TENSORS):
        host = t.detach().to("cpu", copy=True)
        _profile["kept_bytes"] += host.nbytes
        return ("host", host, t.device)
    return ("kept", t)


def _unpack(packed) -> torch.Tensor:
    kind = packed[0]
    if kind == "kept":
        return packed[1]
    if kind == "host":
        return packed[1].to(packed[2], non_blocking=True)
    _, shard, shape, device, chunk = packed
    s = _settings
    full = torch.empty(chunk * s.mp_size, dtype=shard.dtype, device=device)
    comm.all_gather_into_tensor(full, shard.to(device), group=s.mp_group)
    return full[:math.prod(shape)].view(shape)


def _sync() -> None:
    acc = getattr(torch, "accelerator", None)
    if acc is not None and acc.is_available():
        acc.synchronize()


def _timed(function):
    """Wrap ``function`` to time the forward call and the recomputation in backward."""
    def run(*args, **kwargs):
        recompute = torch._C._current_graph_task_id() != -1
        if _settings.synchronize:
            _sync()
        t0 = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            if _settings.synchronize:
                _sync()
            if _settings.profile:
                ms = 1000.0 * (time.perf_counter() - t0)
                _profile["recompute_ms" if recompute else "forward_ms"] += ms
                if not recompute:
                    _profile["calls"] += 1
                if comm.get_rank() == 0:
                    logger.info("activation checkpoint %s: %s %.3f ms", getattr(function, "__name__", "fn"),
                                "recompute" if recompute else "forward", ms)
    return run


def _same_tracker_streams(function):
    """Recompute with the tensor-parallel RNG streams (``get_cuda_rng_tracker``) as they were in the
    forward pass, so dropout inside ``tracker.fork()`` draws the same masks again."""
    tracker = get_cuda_rng_tracker()
    at_forward = tracker.get_states()

    def run(*args, **kwargs):
        if torch._C._current_graph_task_id() == -1:  # the forward pass itself
            return function(*args, **kwargs)
        after = tracker.get_states()
        tracker.set_states(at_forward)
        try:
            return function(*args, **kwargs)
        finally:
            tracker.set_states(after)
    return run


def checkpoint(function, *args, **kwargs):
    """Run ``function(*args, **kwargs)`` keeping only its inputs; recompute its activations in backward."""
    s = _settings
    wrapped = _timed(function) if (s.profile or s.synchronize) else function
    if get_cuda_rng_tracker().states_:
        wrapped = _same_tracker_streams(wrapped)
    hooks = contextlib.nullcontext()
    if s.cpu_checkpointing or (s.partition_activations and s.mp_size > 1):
        hooks = torch.autograd.graph.saved_tensors_hooks(_pack, _unpack)
    with hooks:
        return torch_checkpoint.checkpoint(wrapped, *args, use_reentrant=False, **kwargs)


non_reentrant_checkpoint = checkpoint
