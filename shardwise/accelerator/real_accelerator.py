"""The accelerator object behind ``get_accelerator()``: ``torch.accelerator`` or the CPU.

Method names and arguments are DeepSpeed's (``deepspeed/accelerator/abstract_accelerator.py``).
With an accelerator every call goes to ``torch.accelerator`` (and its ``memory`` functions);
on CPU the answers follow DeepSpeed's CPU accelerator: the device is ``"cpu"``, the backend
``gloo``, memory counters are the process's resident set size, pinning is a no-op.
"""

from __future__ import annotations

import contextlib
import os

import torch

_BACKENDS = {"cuda": "nccl", "xpu": "xccl", "hpu": "hccl", "npu": "hccl", "mps": "gloo"}


def _torch_accelerator() -> str | None:
    acc = getattr(torch, "accelerator", None)
    if acc is not None and acc.is_available():
        return acc.current_accelerator().type
    if torch.cuda.is_available():
        return "cuda"
    return None


def _rss() -> int:
    try:
        import psutil
    except ImportError:  # psutil is optional: read /proc on Linux
        try:
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError):
            return 0
    return psutil.Process().memory_info().rss


class Accelerator:
    """DeepSpeed's accelerator interface over ``torch.accelerator`` (``kind`` set) or the CPU."""

    def __init__(self, kind: str | None = None) -> None:
        self._name = kind or "cpu"
        self._cpu = kind is None
        self._max_rss = _rss() if self._cpu else 0
        self._compile_backend = "inductor"

    def __repr__(self) -> str:
        return f"Accelerator({self._name!r})"

    # -- what kind of device --------------------------------------------------------------
    def is_synchronized_device(self) -> bool:
        return self._cpu

    def use_host_timers(self) -> bool:
        return self.is_synchronized_device()

    def resolves_data_dependency(self) -> bool:
        return self.is_synchronized_device()

    def handles_memory_backpressure(self) -> bool:
        return self.is_synchronized_device()

    def is_available(self) -> bool:
        return True

    def communication_backend_name(self) -> str:
        return "gloo" if self._cpu else _BACKENDS.get(self._name, "gloo")

    def is_triton_supported(self) -> bool:
        return False

    # -- devices ----------------------------------------------------------------------------
    def device_name(self, device_index=None) -> str:
        if self._cpu or device_index is None:
            return self._name
        return f"{self._name}:{device_index}"

    def device(self, device_index=None):
        return None if self._cpu else torch.device(self._name, device_index or 0)

    def set_device(self, device_index) -> None:
        if not self._cpu:
            torch.accelerator.set_device_index(device_index)

    def current_device(self):
        """The current device index (on CPU: LOCAL_RANK, as DeepSpeed's CPU accelerator)."""
        if self._cpu:
            return int(os.environ.get("LOCAL_RANK", 0))
        return torch.accelerator.current_device_index()

    def current_device_name(self) -> str:
        return "cpu" if self._cpu else f"{self._name}:{self.current_device()}"

    def device_count(self) -> int:
        if self._cpu:
            return int(os.environ.get("LOCAL_SIZE", os.environ.get("LOCAL_WORLD_SIZE", 0))) or 1
        return torch.accelerator.device_count()

    def synchronize(self, device_index=None) -> None:
        if not self._cpu:
            torch.accelerator.synchronize(device_index)

    # -- random numbers ---------------------------------------------------------------------
    def random(self):
        return torch.random

    def manual_seed(self, seed):
        return torch.manual_seed(seed)  # seeds the CPU and every accelerator

    def manual_seed_all(self, seed):
        return torch.manual_seed(seed)

    def initial_seed(self) -> int:
        return torch.initial_seed()

    def get_rng_state(self, device_index=None):
        if self._cpu:
            return torch.get_rng_state()
        return self._module().get_rng_state(device_index if device_index is not None else self.current_device())

    def set_rng_state(self, new_state, device_index=None):
        if self._cpu:
            return torch.set_rng_state(new_state)
        return self._module().set_rng_state(new_state, device_index if device_index is not None
                                            else self.current_device())

    def default_generator(self, device_index):
        if self._cpu:
            return torch.default_generator
        return self._module().default_generators[device_index]

    # -- streams and events -----------------------------------------------------------------
    @property
    def Stream(self):  # noqa: N802 - DeepSpeed's name
        """The stream class (``get_accelerator().Stream()``); None on CPU, as in DeepSpeed."""
        return None if self._cpu else torch.Stream

    @property
    def Event(self):  # noqa: N802
        return None if self._cpu else torch.Event

    def stream(self, stream):
        if self._cpu or stream is None:
            return contextlib.nullcontext()
        return torch.accelerator.stream(stream) if hasattr(torch.accelerator, "stream") \
            else self._module().stream(stream)

    def current_stream(self, device_index=None):
        return None if self._cpu else torch.accelerator.current_stream(device_index)

    def default_stream(self, device_index=None):
        return None if self._cpu else self._module().default_stream(device_index)

    # -- memory -----------------------------------------------------------------------------
    def _mem(self):
        return torch.accelerator.memory if hasattr(torch.accelerator, "memory") else torch.accelerator

    def empty_cache(self) -> None:
        if not self._cpu:
            torch.accelerator.empty_cache()

    def get_rss(self) -> int:
        mem = _rss()
        self._max_rss = max(self._max_rss, mem)
        return mem

    def reset_rss(self) -> int:
        self._max_rss = _rss()
        return self._max_rss

    def memory_allocated(self, device_index=None) -> int:
        return self.get_rss() if self._cpu else self._mem().memory_allocated(device_index)

    def max_memory_allocated(self, device_index=None) -> int:
        if self._cpu:
            self.get_rss()
            return self._max_rss
        return self._mem().max_memory_allocated(device_index)

    def reset_max_memory_allocated(self, device_index=None) -> None:
        self.reset_peak_memory_stats(device_index)

    def memory_reserved(self, device_index=None) -> int:
        return self.get_rss() if self._cpu else self._mem().memory_reserved(device_index)

    def max_memory_reserved(self, device_index=None) -> int:
        if self._cpu:
            self.get_rss()
            return self._max_rss
        return self._mem().max_memory_reserved(device_index)

    memory_cached = memory_reserved
    max_memory_cached = max_memory_reserved

    def reset_max_memory_cached(self, device_index=None) -> None:
        self.reset_peak_memory_stats(device_index)

    def reset_peak_memory_stats(self, device_index=None) -> None:
        if self._cpu:
            self.reset_rss()
        else:
            self._mem().reset_peak_memory_stats(device_index)

    def memory_stats(self, device_index=None) -> dict:
        if self._cpu:
            return {"allocated_bytes.all.current": self.get_rss(), "allocated_bytes.all.peak": self._max_rss}
        return self._mem().memory_stats(device_index)

    def total_memory(self, device_index=None) -> int:
        if self._cpu:
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return torch.accelerator.get_memory_info(device_index)[1]

    def available_memory(self, device_index=None) -> int:
        if self._cpu:
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
        return torch.accelerator.get_memory_info(device_index)[0]

    # -- data types -------------------------------------------------------------------------
    def is_bf16_supported(self) -> bool:
        if self._cpu:
            return True
        mod = self._module()
        return bool(mod.is_bf16_supported()) if hasattr(mod, "is_bf16_supported") else True

    def is_fp16_supported(self) -> bool:
        if not self._cpu:
            return True
        try:
            return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
        except (AttributeError, RuntimeError):
            return False

    def supported_dtypes(self) -> list:
        dtypes = [torch.float]
        if self.is_bf16_supported():
            dtypes.append(torch.bfloat16)
        if self.is_fp16_supported():
            dtypes.append(torch.float16)
        return dtypes

    # -- tensors ----------------------------------------------------------------------------
    def pin_memory(self, tensor, make_copy=True, match_shape=True):
        """Page-locked ``tensor`` for fast transfers; unchanged on CPU (nothing to pin for).
        ``make_copy``/``match_shape`` are accepted for DeepSpeed's signature: torch always copies."""
        return tensor if self._cpu or tensor.is_pinned() else tensor.pin_memory()

    def is_pinned(self, tensor) -> bool:
        return False if self._cpu else tensor.is_pinned()

    def unpin_memory(self, tensor) -> None:
        """Nothing to do: torch frees a pinned tensor's page-locked memory when the tensor is collected."""
        return None

    def on_accelerator(self, tensor) -> bool:
        return tensor.device.type == self._name

    # -- misc ---------------------------------------------------------------------------------
    def range_push(self, msg, domain=None, category=None) -> None:
        if self._name == "cuda":
            torch.cuda.nvtx.range_push(msg)

    def range_pop(self, domain=None) -> None:
        if self._name == "cuda":
            torch.cuda.nvtx.range_pop()

    def lazy_call(self, callback):
        return callback()

    def visible_devices_envs(self) -> list[str]:
        return {"xpu": ["ZE_AFFINITY_MASK"], "hpu": ["HABANA_VISIBLE_MODULES"]}.get(self._name, ["CUDA_VISIBLE_DEVICES"])

    def set_visible_devices_envs(self, current_env, local_accelerator_ids) -> None:
        for env in self.visible_devices_envs():
            current_env[env] = ",".join(map(str, local_accelerator_ids))

    def export_envs(self) -> list[str]:
        return ["NCCL"] if self._name == "cuda" else []

    def get_compile_backend(self) -> str:
        return self._compile_backend

    def set_compile_backend(self, backend) -> None:
        supported = torch._dynamo.list_backends(exclude_tags=())
        if backend not in supported:
            raise ValueError(f"{backend} not supported by {self.device_name()}. Supported backends are {supported}")
        self._compile_backend = backend

    def _module(self):
        return getattr(torch, self._name)


_current: list[Accelerator | None] = [None]


def get_accelerator() -> Accelerator:
    """This process's accelerator (created on first call). ``DS_ACCELERATOR=cpu`` forces the CPU."""
    if _current[0] is None:
        forced = os.environ.get("DS_ACCELERATOR")
        kind = None if forced == "cpu" else _torch_accelerator()
        if forced and forced != "cpu" and forced != kind:
            raise ValueError(f"DS_ACCELERATOR={forced!r}, but the accelerator torch sees is {kind or 'none (CPU)'}")
        _current[0] = Accelerator(kind)
    return _current[0]


def set_accelerator(accel_obj) -> None:
    _current[0] = accel_obj
