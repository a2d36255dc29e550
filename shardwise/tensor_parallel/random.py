"""Named RNG streams for tensor parallelism (Megatron/DeepSpeed's ``CudaRNGStatesTracker``).

Dropout on a tensor-sharded activation (attention probabilities of this rank's heads) must differ
across tensor ranks; dropout on a replicated activation must agree. ``model_parallel_cuda_manual_seed``
seeds the default generator identically on the tensor ranks (``seed``) and registers a
``"model-parallel-rng"`` stream seeded per tensor rank; run the sharded region inside
``get_cuda_rng_tracker().fork()``. Despite the names (kept for compatibility) the streams live on
the accelerator's generator: CUDA's on a GPU, the CPU generator otherwise.
"""

from __future__ import annotations

import contextlib

import torch

__all__ = ["CudaRNGStatesTracker", "get_cuda_rng_tracker", "model_parallel_cuda_manual_seed",
           "model_parallel_reconfigure_tp_seed", "RNGStatesTracker"]

_MODEL_PARALLEL_RNG_TRACKER_NAME = "model-parallel-rng"


def _use_cuda() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def _get_state() -> torch.Tensor:
    return torch.cuda.get_rng_state() if _use_cuda() else torch.get_rng_state()


def _set_state(state: torch.Tensor) -> None:
    if _use_cuda():
        torch.cuda.set_rng_state(state)
    else:
        torch.set_rng_state(state)


def _seeded_state(seed: int) -> torch.Tensor:
    saved = _get_state()
    try:
        if _use_cuda():
            torch.cuda.manual_seed(seed)
        else:
            torch.manual_seed(seed)
        return _get_state()
    finally:
        _set_state(saved)


class CudaRNGStatesTracker:
    """Named generator states; ``fork(name)`` runs a block on that stream and saves where it got to."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()

    def get_states(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.states_.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self.states_ = {k: v.clone() for k, v in states.items()}

    def add(self, name: str, seed: int) -> None:
        if seed in self.seeds_:
            raise ValueError(f"RNG tracker: seed {seed} already exists")
        if name in self.states_:
            raise ValueError(f"RNG tracker: state {name!r} already exists")
        self.seeds_.add(seed)
        self.states_[name] = _seeded_state(seed)

    @contextlib.contextmanager
    def fork(self, name: str = _MODEL_PARALLEL_RNG_TRACKER_NAME):
        if name not in self.states_:
            raise KeyError(f"RNG tracker: no state named {name!r} (call model_parallel_cuda_manual_seed first)")
        outside = _get_state()
        _set_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = _get_state()
            _set_state(outside)


RNGStatesTracker = CudaRNGStatesTracker
_TRACKER = CudaRNGStatesTracker()
_CUDA_RNG_STATE_TRACKER = _TRACKER  # DeepSpeed's and Megatron's name for the one tracker


def _set_cuda_rng_state(new_state: torch.Tensor, device=-1) -> None:
    """Make ``new_state`` the current generator state: the accelerator's (CUDA's once it is in use),
    the CPU generator's otherwise (DeepSpeed's helper; ``device`` is accepted for its signature)."""
    _set_state(new_state)


def get_cuda_rng_tracker() -> CudaRNGStatesTracker:
    return _TRACKER


def _tensor_rank() -> int:
    """The active grid's tensor rank (``initialize``'s grid, a ``with grid.active():`` scope, or the mpu
    given to ``checkpointing.configure``, which activates it); 0 without one."""
    from shardwise.topology import active_grid

    grid = active_grid()
    return grid.axis_rank("model") if grid is not None else 0


def model_parallel_cuda_manual_seed(seed: int, tp_rank: int | None = None) -> None:
    """Seed the default generator with ``seed`` (the same on the tensor ranks) and the tracker's
    ``"model-parallel-rng"`` stream with ``seed + 2718 + tensor rank`` (Megatron's offsets). The
    tensor rank is the active grid's unless given."""
    rank = _tensor_rank() if tp_rank is None else int(tp_rank)
    if _use_cuda():
        torch.cuda.manual_seed(seed)
    else:
        torch.manual_seed(seed)
    _TRACKER.reset()
    _TRACKER.add(_MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + rank)


def model_parallel_reconfigure_tp_seed(seed: int) -> None:
    """Re-seed only the tensor-parallel stream (DeepSpeed's function)."""
    rank = _tensor_rank()
    _TRACKER.states_.pop(_MODEL_PARALLEL_RNG_TRACKER_NAME, None)
    _TRACKER.seeds_.discard(seed + 2718 + rank)
    _TRACKER.add(_MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + rank)
