"""Measured peak memory of a block of code, on an accelerator or on the CPU.

    with PeakMemory(device) as peak:
        loss = model(x).sum(); loss.backward()
    print(peak.bytes)        # highest memory in use during the block, above its level at entry

Accelerators use the allocator's peak statistics. On the CPU (Linux) the process's peak
resident size (``VmHWM``) is reset through ``/proc/self/clear_refs`` at entry; glibc is told
to give large blocks back to the system when freed (a fixed ``M_MMAP_THRESHOLD``), so memory
freed before the block does not hide the block's own peak.
"""

from __future__ import annotations

import gc

import torch

from shardwise.malloc import return_large_frees_to_the_os

__all__ = ["PeakMemory"]



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
