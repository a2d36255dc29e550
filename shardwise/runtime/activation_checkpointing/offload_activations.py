"""Offload the inputs of Hugging Face gradient-checkpointed layers to host memory (ALST).

``deepspeed.runtime.activation_checkpointing.offload_activations`` under the same names:

    from shardwise.runtime.activation_checkpointing.offload_activations import (
        get_checkpoint_hidden_states_offloading_ctx_manager)

    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    with get_checkpoint_hidden_states_offloading_ctx_manager():
        loss = engine(**batch).loss
        engine.backward(loss)

With gradient checkpointing a decoder layer keeps only its input ``hidden_states`` until
backward recomputes it; for long sequences those inputs, one per layer, are what is left in
accelerator memory.  Inside the context the input of every ``GradientCheckpointingLayer`` is
copied to (pinned) host memory when autograd saves it and copied back when backward needs it;
the newest ``keep_last_count`` stay on the device (backward needs them first).  Other saved
tensors are untouched.  On CUDA the copies run on a side stream.  Tensors already in host
memory (a CPU run) are left alone, as in DeepSpeed: there is nothing to gain.

Host buffers are reused: once a host copy has been copied back (and that copy has finished), its
buffer goes to a pool keyed by shape, dtype, layout and pinning (``_buffer_key``; the host copies are
dense, so sources that differ only in strides share buffers), holding at most
``max_cpu_buffer_pool_count`` buffers, and the next offload of that shape takes it instead of
allocating (and pinning, through the accelerator's ``pin_memory``) a new one (``_empty_cpu_like``).
Unlike DeepSpeed, an offloaded tensor's host copy belongs to the saved-tensor record until it is
copied back, so backward may also run after the context has exited.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass

import torch
from torch.autograd.graph import saved_tensors_hooks

__all__ = ["CheckpointActivationOffloadStats", "CheckpointHiddenStatesOffload",
           "get_checkpoint_hidden_states_offloading_ctx_manager", "patch_gradient_checkpointing_layer_marker"]

_TLS = threading.local()
_PATCH = {"original": None, "wrapper": None, "users": 0}
_LOCK = threading.Lock()


@dataclass
class CheckpointActivationOffloadStats:
    saved_tensors_seen: int = 0
    marked_tensors: int = 0
    offloaded_tensors: int = 0
    restored_tensors: int = 0
    skipped_marked_tensors: int = 0
    kept_last_tensors: int = 0
    offloaded_bytes: int = 0
    restored_bytes: int = 0


def _active() -> list:
    if not hasattr(_TLS, "stack"):
        _TLS.stack = []
    return _TLS.stack


def patch_gradient_checkpointing_layer_marker() -> None:
    """Make ``transformers.GradientCheckpointingLayer.__call__`` mark its ``hidden_states`` (the
    first positional argument) for offloading while a ``CheckpointHiddenStatesOffload`` is active."""
    if _PATCH["wrapper"] is not None:
        return
    try:
        from transformers import GradientCheckpointingLayer
    except ImportError as e:
        raise RuntimeError("activation offload for gradient checkpointing needs transformers >= 4.52 "
                           "(GradientCheckpointingLayer)") from e
    original_call = GradientCheckpointingLayer.__call__

    def __call__(self, *args, **kwargs):
        stack = _active()
        manager = stack[-1] if stack else None
        marked = None
        if (manager is not None and self.training and torch.is_grad_enabled()
                and getattr(self, "gradient_checkpointing", False) and args and torch.is_tensor(args[0])):
            marked = args[0]
            manager.mark(marked)
        try:
            return original_call(self, *args, **kwargs)
        finally:
            if marked is not None:
                manager._unmark(marked)  # the id may be reused by a later tensor

    _PATCH["original"] = GradientCheckpointingLayer.__dict__.get("__call__")
    _PATCH["wrapper"] = __call__
    GradientCheckpointingLayer.__call__ = __call__


def _unpatch() -> None:
    wrapper, original = _PATCH["wrapper"], _PATCH["original"]
    _PATCH["wrapper"] = _PATCH["original"] = None
    if wrapper is None:
        return
    from transformers import GradientCheckpointingLayer

    if GradientCheckpointingLayer.__dict__.get("__call__") is wrapper:
        if original is None:
            del GradientCheckpointingLayer.__call__
        else:
            GradientCheckpointingLayer.__call__ = original


class _Saved:
    """One offloaded tensor: the device tensor while it is among the newest, then a host copy."""

    __slots__ = ("device_tensor", "host", "key", "device", "event", "restored")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.device_tensor = tensor
        self.host = None
        self.key = None  # the host buffer's pool key
        self.device = tensor.device
        self.event = None
        self.restored = None  # the copy back, for a graph unpacked again (retain_graph)


class CheckpointHiddenStatesOffload(saved_tensors_hooks):
    """The context manager: saved-tensor hooks that move marked layer inputs to host memory."""

    def __init__(self, use_pin_memory: bool = True, use_streams: bool = True, min_offload_bytes: int = 1024,
                 max_fwd_stash_count: int = 2, max_cpu_buffer_pool_count: int = 64, keep_last_count: int = 1):
        for name, value in (("keep_last_count", keep_last_count), ("max_fwd_stash_count", max_fwd_stash_count),
                            ("max_cpu_buffer_pool_count", max_cpu_buffer_pool_count),
                            ("min_offload_bytes", min_offload_bytes)):
            if value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        self.use_pin_memory = use_pin_memory
        self.use_streams = use_streams
        self.min_offload_bytes = min_offload_bytes
        self.max_fwd_stash_count = max_fwd_stash_count  # (DeepSpeed's stash tuning: accepted, not needed here)
        self.max_cpu_buffer_pool_count = max_cpu_buffer_pool_count
        self._pool: dict[tuple, list[torch.Tensor]] = {}  # free host buffers by _buffer_key
        self._pool_count = 0
        self._pending: list[tuple[tuple, torch.Tensor, object]] = []  # (key, buffer, event of its copy back)
        self.keep_last_count = keep_last_count
        self.stats = CheckpointActivationOffloadStats()
        self._marks: dict[int, int] = {}
        self._newest: list[_Saved] = []
        self._streams: dict[str, object] = {}
        self._copy_cpu_tensors = False  # tests: exercise the copy path on a CPU-only machine
        super().__init__(self._pack, self._unpack)

    # -- marking (GradientCheckpointingLayer.__call__) ---------------------------------------
    def mark(self, tensor: torch.Tensor) -> None:
        self._marks[id(tensor)] = self._marks.get(id(tensor), 0) + 1
        self.stats.marked_tensors += 1

    def _unmark(self, tensor: torch.Tensor) -> bool:
        n = self._marks.get(id(tensor), 0)
        if n == 0:
            return False
        if n == 1:
            del self._marks[id(tensor)]
        else:
            self._marks[id(tensor)] = n - 1
        return True

    # -- saved-tensor hooks ------------------------------------------------------------------
    def _should_offload(self, t: torch.Tensor) -> bool:
        on_host = t.device.type == "cpu"
        return ((not on_host or self._copy_cpu_tensors) and t.numel() * t.element_size() >= self.min_offload_bytes
                and not isinstance(t, torch.nn.Parameter) and not (t.numel() > 1 and 0 in t.stride()))

    def _pack(self, t: torch.Tensor):
        self.stats.saved_tensors_seen += 1
        if not self._unmark(t):
            return t
        if not self._should_offload(t):
            self.stats.skipped_marked_tensors += 1
            return t
        saved = _Saved(t.detach())
        self._newest.append(saved)
        while len(self._newest) > self.keep_last_count:
            self._to_host(self._newest.pop(0))
        return saved

    def _unpack(self, packed):
        if not isinstance(packed, _Saved):
            return packed
        if packed.device_tensor is not None:  # one of the newest: never left the device
            if packed in self._newest:
                self._newest.remove(packed)
                self.stats.kept_last_tensors += 1
            return packed.device_tensor
        out = self._to_device(packed)
        self.stats.restored_tensors += 1
        self.stats.restored_bytes += out.numel() * out.element_size()
        return out

    # -- copies ------------------------------------------------------------------------------
    def _side_stream(self, device: torch.device):
        if not self.use_streams or device.type == "cpu":
            return None
        module = torch.get_device_module(device)
        key = str(device)
        if key not in self._streams:
            self._streams[key] = module.Stream(device=device)
        return self._streams[key]

    # -- the host-buffer pool ------------------------------------------------------------------
    def _buffer_key(self, tensor: torch.Tensor) -> tuple:
        """Which pooled host buffers can hold ``tensor``'s copy (strides do not matter: copies are dense)."""
        return tuple(tensor.size()), tensor.dtype, tensor.layout, self.use_pin_memory

    def _give_back(self, key: tuple, buffer: torch.Tensor) -> None:
        if self._pool_count < self.max_cpu_buffer_pool_count:
            self._pool.setdefault(key, []).append(buffer)
            self._pool_count += 1

    def _reap_pending(self) -> None:
        """Pool the buffers whose copy back to the device has finished."""
        still = []
        for key, buffer, event in self._pending:
            if event.query():
                self._give_back(key, buffer)
            else:
                still.append((key, buffer, event))
        self._pending = still

    def _empty_cpu_like(self, tensor: torch.Tensor) -> tuple[torch.Tensor, tuple]:
        """A dense host buffer of ``tensor``'s shape and dtype (from the pool, else new and, with
        ``use_pin_memory``, pinned through the accelerator), and its pool key."""
        self._reap_pending()
        key = self._buffer_key(tensor)
        free = self._pool.get(key)
        if free:
            self._pool_count -= 1
            return free.pop(), key
        host = torch.empty(tuple(tensor.size()), dtype=tensor.dtype, layout=tensor.layout, device="cpu")
        if self.use_pin_memory:
            from shardwise.accelerator import get_accelerator

            host = get_accelerator().pin_memory(host, make_copy=False)
        return host, key

    def _to_host(self, saved: _Saved) -> None:
        t = saved.device_tensor
        host, saved.key = self._empty_cpu_like(t)
        stream = self._side_stream(t.device)
        if stream is None:
            host.copy_(t)
        else:
            module = torch.get_device_module(t.device)
            stream.wait_stream(module.current_stream(t.device))
            with module.stream(stream):
                host.copy_(t, non_blocking=True)
                saved.event = stream.record_event()
            t.record_stream(stream)  # the device memory is not reused before the copy is done
        saved.host = host
        saved.device_tensor = None
        self.stats.offloaded_tensors += 1
        self.stats.offloaded_bytes += host.numel() * host.element_size()

    def _to_device(self, saved: _Saved) -> torch.Tensor:
        if saved.restored is not None:
            return saved.restored
        if saved.event is not None:
            saved.event.synchronize()  # the host copy is complete
        if saved.device.type == "cpu":  # (tests' copy path on a CPU run: the host copy is the tensor)
            return saved.host
        host = saved.host
        out = host.to(saved.device, non_blocking=host.is_pinned())
        saved.restored, saved.host = out, None
        if host.is_pinned():  # the buffer is reused once this copy is done
            module = torch.get_device_module(saved.device)
            event = module.Event()
            event.record(module.current_stream(saved.device))
            self._pending.append((saved.key, host, event))
        else:
            self._give_back(saved.key, host)
        return out

    # -- context -----------------------------------------------------------------------------
    def reset(self) -> None:
        self.stats = CheckpointActivationOffloadStats()
        self._marks.clear()
        self._newest.clear()

    def __enter__(self):
        if self in _active():
            raise RuntimeError("CheckpointHiddenStatesOffload is not re-entrant; use a separate instance for a "
                               "nested context")
        with _LOCK:
            if _PATCH["wrapper"] is None:
                with contextlib.suppress(RuntimeError):  # without transformers nothing is ever marked
                    patch_gradient_checkpointing_layer_marker()
            _PATCH["users"] += 1
        self.reset()
        _active().append(self)
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            _active().remove(self)
            self._marks.clear()
            self._newest.clear()  # (tensors still saved keep their own copies)
            with _LOCK:
                _PATCH["users"] -= 1
                if _PATCH["users"] == 0:
                    _unpatch()


def get_checkpoint_hidden_states_offloading_ctx_manager(use_pin_memory: bool = True, use_streams: bool = True,
                                                        min_offload_bytes: int = 1024, max_fwd_stash_count: int = 2,
                                                        max_cpu_buffer_pool_count: int = 64,
                                                        keep_last_count: int = 1) -> CheckpointHiddenStatesOffload:
    """A new ``CheckpointHiddenStatesOffload`` (DeepSpeed's arguments)."""
    return CheckpointHiddenStatesOffload(use_pin_memory=use_pin_memory, use_streams=use_streams,
                                         min_offload_bytes=min_offload_bytes,
                                         max_fwd_stash_count=max_fwd_stash_count,
                                         max_cpu_buffer_pool_count=max_cpu_buffer_pool_count,
                                         keep_last_count=keep_last_count)
