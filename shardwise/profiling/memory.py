"""Measured peak memory of a block of code, on an accelerator or on the CPU.

    with PeakMemory(device) as peak:
        loss = model(x).sum(); loss.backward()
    print(peak.bytes)        # highest memory in use during the block, above its level at entry

Accelerators use the allocator's peak statistics. On the CPU (Linux) the process's peak
resident size (``VmHWM``) is reset through ``/proc/self/clear_refs`` at entry; glibc is told
to give large blocks back to the system when freed (a fixed ``M_MMAP_THRESHOLD``), so memory
freed before the block does not hide the block's own peak.

``LiveTensorPeak`` counts tensors instead of memory: the bytes of every storage Python can reach,
sampled during backward and around the step (what ZeRO's formulas speak of, whatever the load).
"""

from __future__ import annotations

import gc

import torch

from shardwise.malloc import return_large_frees_to_the_os

__all__ = ["LiveTensorPeak", "PeakMemory", "live_tensor_bytes"]



def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _cpu_setup() -> None:
    # Freed blocks of 128 KiB and more go back to the system, so memory freed before the block does
    # not hide its peak (without glibc peaks may read high after big frees, never low).
    return_large_frees_to_the_os(128 * 1024)


class PeakMemory:
    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.bytes = 0
        self._start = 0

    def __enter__(self) -> "PeakMemory":
        gc.collect()
        if self.device.type == "cpu":
            _cpu_setup()
            try:
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")  # reset the peak resident set size to the current one
            except OSError as exc:
                raise RuntimeError("measuring CPU peak memory needs Linux's /proc/self/clear_refs") from exc
            self._start = _status_kib("VmRSS") * 1024
        else:
            mod = getattr(torch, self.device.type)
            mod.synchronize()
            mod.reset_peak_memory_stats(self.device)
            self._start = mod.memory_allocated(self.device)
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cpu":
            self.bytes = _status_kib("VmHWM") * 1024 - self._start
        else:
            mod = getattr(torch, self.device.type)
            mod.synchronize()
            self.bytes = mod.max_memory_allocated(self.device) - self._start


def collect_garbage(max_passes: int = 8) -> None:
    """``gc.collect()`` until a pass finds nothing (at most ``max_passes``): a dropped ZeRO-3 engine's model
    and parameter coordinator go on the second pass, not the first (torch holds some Python objects from C++,
    out of the collector's sight, such as a parameter's table of gradient hooks)."""
    for _ in range(max_passes):
        if gc.collect() == 0:
            return


def live_tensor_bytes() -> int:
    """Bytes held by the distinct storages of every tensor Python can reach now (parameters, their
    ``.grad``, optimizer states, buffers kept by the framework; not autograd's saved activations).
    Independent of the machine's load and of the allocator; a walk of the garbage collector's objects,
    so slow: for measurements, not for training."""
    collect_garbage()  # unreachable cycles (an engine dropped a moment ago) are not live
    seen: dict[tuple, int] = {}
    for obj in gc.get_objects():
        if not isinstance(obj, torch.Tensor) or obj.is_meta or obj.layout != torch.strided:
            continue
        try:
            storage = obj.untyped_storage()
        except (RuntimeError, NotImplementedError):  # a tensor subclass without storage
            continue
        if storage.device.type == "meta":  # a fake tensor (torch.compile keeps some): no memory, maybe a symbolic size
            continue
        seen[(storage.device, storage.data_ptr())] = storage.nbytes()
    return sum(seen.values())


class LiveTensorPeak:
    """The highest ``live_tensor_bytes`` seen at the sampling points: ``sample()`` where you like,
    and, once ``watch(module)`` is called, whenever a parameter's gradient has been accumulated in
    backward (after the hooks registered before it, such as ZeRO's gradient reduction)."""

    def __init__(self) -> None:
        self.bytes = 0
        self._hooks = []

    def sample(self) -> int:
        now = live_tensor_bytes()
        self.bytes = max(self.bytes, now)
        return now

    def watch(self, module: torch.nn.Module) -> "LiveTensorPeak":
        for p in module.parameters():
            if p.requires_grad:
                self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad))
        return self

    def _on_grad(self, _param) -> None:
        self.sample()

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
