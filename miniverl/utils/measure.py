"""Measurements the report records: clocks from process start, peak memory, bytes on disk, and
the identity of the code that drove the workload."""

from __future__ import annotations

import ctypes
import functools
import gc
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

import miniverl
from miniverl import STARTED_AT
from miniverl.utils.identity import sha256_file, sha256_json

PACKAGE_DIR = Path(miniverl.__file__).resolve().parent  # the whole package, not this module's folder
GIB = 2**30  # bytes


def seconds_since_start() -> float:
    """Seconds since the interpreter imported miniverl (`miniverl.STARTED_AT`): the clock of the
    report's cold start and times to first rollout, teacher targets and update."""
    return time.time() - STARTED_AT


def peak_rss_gib() -> float:
    """Peak resident memory of this process (the CPU's counterpart of CUDA's peak reserved). On
    Linux, VmHWM: the high-water mark of this program's memory, which starts afresh at exec (the
    rusage maximum would carry the parent's peak into the resume check's children)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return round(int(line.split()[1]) / 2**20, 4)  # kB
    except OSError:
        pass
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    scale = 1 if sys.platform == "darwin" else 1024  # macOS reports bytes, Linux KiB
    return round(peak_kib * scale / GIB, 4)


def cuda_peaks(device: torch.device) -> tuple[float | None, float | None]:
    """Peak allocated and reserved GiB of the CUDA caching allocator; nulls off CUDA."""
    if device.type != "cuda":
        return None, None
    return (
        round(torch.cuda.max_memory_allocated(device) / GIB, 4),
        round(torch.cuda.max_memory_reserved(device) / GIB, 4),
    )


def free_device_cache(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


@functools.cache
def glibc():
    """The C library's handle where it is glibc (Linux), else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def trim_heap() -> None:
    """Hand the C heap's free memory back to the OS (glibc's malloc_trim; elsewhere nothing). Loading
    a model frees its full-precision weights once they are quantized, and glibc keeps that memory
    for later allocations: on the real recipe ~0.6 GiB of resident memory nothing uses."""
    libc = glibc()
    if libc is not None:
        libc.malloc_trim(0)


def release_memory(device: torch.device, *, compiled: bool = False) -> None:
    """Give back the memory of objects just dropped: collect reference cycles (models and their
    hooks form some), and on CUDA return the allocator's cached blocks to the driver, so that
    another process can use them. `compiled`: also drop torch.compile's caches, whose graphs
    (CUDA graphs included) keep the compiled model and its memory pool alive."""
    if compiled:
        torch._dynamo.reset()
    gc.collect()
    free_device_cache(device)
    trim_heap()


def _four_bit_layers(model: torch.nn.Module) -> list:
    try:
        import bitsandbytes as bnb
    except ImportError:
        return []
    return [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]


def _four_bit_scales_bytes(layer) -> int:
    """A 4-bit layer's block scales (in its quant_state beside the packed weight, not buffers)."""
    state = layer.weight.quant_state
    scales = (state.absmax, getattr(getattr(state, "state2", None), "absmax", None))
    return sum(t.numel() * t.element_size() for t in scales if t is not None)


def four_bit_storage_bytes(model: torch.nn.Module) -> int:
    """Bytes of a model's bitsandbytes 4-bit weights as stored (packed weight + block scales)."""
    return sum(
        m.weight.data.numel() * m.weight.data.element_size() + _four_bit_scales_bytes(m)
        for m in _four_bit_layers(model)
    )


def stored_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes a model's weights hold in memory: every parameter and buffer as stored (4-bit ones
    packed, tied ones once) plus the 4-bit block scales."""
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    stored = sum(t.numel() * t.element_size() for t in tensors.values())
    return stored + sum(_four_bit_scales_bytes(m) for m in _four_bit_layers(model))


def folder_bytes(folder: Path, exclude: tuple[str, ...] = ()) -> int:
    """Bytes of every file below `folder`, leaving out top-level entries named in `exclude`."""
    if not folder.exists():
        return 0
    return sum(
        p.stat().st_size for p in folder.rglob("*") if p.is_file() and p.relative_to(folder).parts[0] not in exclude
    )


def workload_driver_sha256() -> str:
    """sha256 of the miniverl source that drove the run: canonical list of (path, sha256) of every
    .py file of the package, sorted by path."""
    files = sorted(PACKAGE_DIR.rglob("*.py"))
    return sha256_json([[p.relative_to(PACKAGE_DIR).as_posix(), sha256_file(p)] for p in files])


def source_commit() -> str | None:
    """The git commit of the checkout miniverl runs from; null outside a git checkout."""
    try:
        out = subprocess.run(
            ["git", "-C", str(PACKAGE_DIR), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10, check=True
        )
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None
