"""The device a run executes on, its determinism switches, and the facts the report records."""

from __future__ import annotations

import os
import platform
import subprocess
import time
from contextlib import contextmanager
from importlib.metadata import PackageNotFoundError, version

import torch

from miniverl.errors import MiniverlError
from miniverl.schema.hardware import HardwareConfig


def resolve_device(hardware: HardwareConfig) -> torch.device:
    if hardware.device == "cuda" or (hardware.device == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise MiniverlError(f"hardware={hardware.name} needs CUDA, but torch sees no GPU "
                                f"(torch {torch.__version__}); use hardware=cpu or hardware=auto")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def set_determinism(device: torch.device, deterministic: bool) -> None:
    if not deterministic:
        return
    if device.type == "cuda":
        # cuBLAS needs a fixed workspace to be deterministic; set before its first use.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.backends.cudnn.benchmark = False
        torch.backends.cuda.matmul.allow_tf32 = False
    torch.use_deterministic_algorithms(True, warn_only=True)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextmanager
def timed(name: str, timings: dict[str, float], device: torch.device):
    """Wall time of a phase into timings[name]; waits for queued GPU work so the figure is true."""
    synchronize(device)
    start = time.perf_counter()
    try:
        yield
    finally:
        synchronize(device)
        timings[name] = time.perf_counter() - start


def package_version(name: str) -> str | None:
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def nvidia_driver() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10, check=True)
        return out.stdout.strip().splitlines()[0] or None
    except (OSError, subprocess.SubprocessError, IndexError):
        return None


def hardware_facts(device: torch.device) -> dict:
    """The report's `hardware` block. GPU fields are null on the CPU (never invented)."""
    cuda = device.type == "cuda"
    props = torch.cuda.get_device_properties(device) if cuda else None
    return {
        "bitsandbytes": package_version("bitsandbytes"),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "cuda_runtime": torch.version.cuda if cuda else None,
        "device": device.type,
        "driver": nvidia_driver() if cuda else None,
        "gpu": props.name if cuda else None,
        "gpu_count": torch.cuda.device_count() if cuda else 0,
        "peft": package_version("peft"),
        "torch": torch.__version__,
        "transformers": package_version("transformers"),
        "vram_gib": round(props.total_memory / 2**30, 3) if cuda else None,
    }
