"""Timing and memory measuring: interleaved rounds of wall-clock timings (with the device
synchronized), the peak memory a call adds, and the median and best of several timings."""

from __future__ import annotations

import os
import re
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from miniverl.utils.device import synchronize
from miniverl.utils.measure import free_device_cache, glibc


# ---------------------------------------------------------------------------------------------- measuring
def seconds(fn: Callable[[], object], device: torch.device) -> tuple[float, object]:
    synchronize(device)
    start = time.perf_counter()
    result = fn()
    synchronize(device)
    return time.perf_counter() - start, result


def rounds(
    methods: dict[str, Callable[[], object]], device: torch.device, repeats: int, warmup: int = 1
) -> dict[str, list[tuple[float, object]]]:
    """Each method once per round, interleaved (a busy machine slows every method alike)."""
    for _ in range(warmup):
        for fn in methods.values():
            fn()
    out = {name: [] for name in methods}
    for _ in range(repeats):
        for name, fn in methods.items():
            out[name].append(seconds(fn, device))
    return out


class PeakMemory:
    """Peak bytes a call adds: CUDA allocator peak, or on Linux the process's peak RSS."""

    def __init__(self, device: torch.device):
        self.device = device
        self.reason = None
        if device.type == "cuda":
            return
        if not (sys.platform.startswith("linux") and os.path.exists("/proc/self/clear_refs")):
            self.reason = "peak memory on the CPU needs Linux (/proc/self/clear_refs)"
            return
        self.libc = glibc()
        if self.libc is None:
            self.reason = "glibc not found"
        self.pinned = False

    @staticmethod
    def _status(key: str) -> int:
        text = Path("/proc/self/status").read_text()
        return int(re.search(rf"{key}:\s+(\d+) kB", text).group(1)) * 1024

    def measure(self, fn: Callable[[], object]) -> int | None:
        if self.reason:
            return None
        if self.device.type == "cuda":
            synchronize(self.device)
            free_device_cache(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            base = torch.cuda.memory_allocated(self.device)
            fn()
            synchronize(self.device)
            return torch.cuda.max_memory_allocated(self.device) - base
        if not self.pinned:
            # Pin glibc's mmap threshold (no dynamic growth): large buffers are then mmapped and go
            # back to the OS when freed, so the RSS follows the live tensors. It slows allocation,
            # hence memory is measured after every timing.
            self.libc.mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD
            self.pinned = True
        self.libc.malloc_trim(0)
        Path("/proc/self/clear_refs").write_text("5")  # resets the peak RSS to the current RSS
        base = self._status("VmRSS")
        fn()
        return self._status("VmHWM") - base


def peak_memory(memory: PeakMemory, calls: dict[str, Callable[[], object]], rounds: int = 3) -> dict:
    """Each call's smallest peak over a few alternating measurements: one-off allocations (kernel
    scratch buffers, allocator growth) land in whichever call happens to trigger them."""
    peaks: dict[str, list] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, fn in calls.items():
            peaks[name].append(memory.measure(fn))
    return {name: (min(values) if None not in values else None) for name, values in peaks.items()}


def median(values: list[float]) -> float:
    return statistics.median(values)


def best(values: list[float]) -> float:
    """The least disturbed of several timings (the ratios use these)."""
    return min(values)


def memory_bandwidth_bytes_per_s(megabytes: int = 256, repeats: int = 5) -> float:
    """This machine's memory bandwidth as a copy of a buffer far larger than the caches sees it
    (bytes read plus bytes written per second, best of a few)."""
    source = torch.ones(megabytes * 2**20, dtype=torch.uint8)
    target = torch.empty_like(source)
    target.copy_(source)  # touch every page first
    fastest = min(seconds(lambda: target.copy_(source), torch.device("cpu"))[0] for _ in range(repeats))
    return 2 * source.numel() / fastest
