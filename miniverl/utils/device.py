"""The device a run executes on, its determinism switches, and the facts the report records."""

from __future__ import annotations

import functools
import os
import platform
import subprocess
import time
from contextlib import contextmanager
from importlib.metadata import PackageNotFoundError, version

import torch

from miniverl.config.hardware import HardwareConfig
from miniverl.utils.errors import MiniverlError
from miniverl.utils.measure import GIB


def wants_cuda(hardware: HardwareConfig) -> bool:
    """Whether `hardware.device` asks for CUDA: `cuda`, or `auto` where a GPU is present."""
    return hardware.device == "cuda" or (hardware.device == "auto" and torch.cuda.is_available())


def resolve_device(hardware: HardwareConfig) -> torch.device:
    if wants_cuda(hardware):
        if not torch.cuda.is_available():
            # The preset named the device (hardware=rtx4080_16gb) or the command line did (hardware.device=cuda).
            raise MiniverlError(
                f"hardware.device=cuda (hardware={hardware.name}) needs CUDA, but torch sees no GPU "
                f"(torch {torch.__version__}); run on the CPU with hardware=cpu and no hardware.device override"
            )
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# cuBLAS is deterministic only with a fixed workspace; these are the two sizes torch accepts.
CUBLAS_WORKSPACES = (":4096:8", ":16:8")
# =1 puts torch's NaN fill of new tensors back (below): a read of memory nothing wrote then shows as NaN.
FILL_UNINITIALIZED_ENV = "MINIVERL_FILL_UNINITIALIZED_MEMORY"
# transformers' flash-attention integration reads it (modeling_flash_attention_utils): "1" = deterministic backward.
FLASH_DETERMINISTIC_ENV = "FLASH_ATTENTION_DETERMINISTIC"
SDP_BACKENDS = ("flash", "mem_efficient", "cudnn", "math")  # torch's scaled-dot-product attention kernels


def set_determinism(device: torch.device, deterministic: bool) -> None:
    """`hardware.deterministic`: strict deterministic kernels, the ground of byte-exact resume.

    Strict (`warn_only=False`): an op without a deterministic kernel stops the run instead of
    warning while it silently breaks exactness. On CUDA also: cuBLAS with a fixed workspace
    (CUBLAS_WORKSPACE_CONFIG=:4096:8, set before cuBLAS's first use), cuDNN without benchmarking
    (which may pick a different algorithm per process), no TF32, and scaled-dot-product attention
    on its math backend only: the flash, memory-efficient and cuDNN backends are switched off,
    since their backward passes accumulate in a nondeterministic order.

    Cost: the math backend materialises the (heads, L, L) attention matrix, so attention takes
    more memory and time than on the flash / memory-efficient kernels, most at long sequences.
    `hardware.deterministic=false` leaves torch's defaults (fused attention kernels, TF32 as
    torch sets it, nondeterministic ops allowed), at the price of byte-exact resume on CUDA.
    On the CPU only the strict mode applies (its kernels are deterministic already).
    """
    if not deterministic:
        return
    if device.type == "cuda":
        if os.environ.get("CUBLAS_WORKSPACE_CONFIG") not in CUBLAS_WORKSPACES:
            os.environ["CUBLAS_WORKSPACE_CONFIG"] = CUBLAS_WORKSPACES[0]
        torch.backends.cudnn.benchmark = False
        torch.backends.cudnn.deterministic = True
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.enable_flash_sdp(False)
        torch.backends.cuda.enable_mem_efficient_sdp(False)
        if hasattr(torch.backends.cuda, "enable_cudnn_sdp"):  # torch >= 2.3
            torch.backends.cuda.enable_cudnn_sdp(False)
        torch.backends.cuda.enable_math_sdp(True)
        # attn_implementation=flash_attention_2: its backward is deterministic only when asked, and
        # transformers asks only where this is set (torch's strict mode does not reach its kernels).
        os.environ[FLASH_DETERMINISTIC_ENV] = "1"
    torch.use_deterministic_algorithms(True, warn_only=False)
    # Strict mode also fills every new tensor with NaN (or an integer's maximum) in case an op reads
    # memory nothing wrote. Nothing here does: a run computes the same bits with and without the fill
    # (tests/e2e/test_qwen3_layout.py), and torch says such a program stays deterministic with it off.
    # Its cost: 15 % of the real CPU recipe's time as the AVX2 kind runs it (recipes/opd_k1_real_cpu/README.md).
    torch.utils.deterministic.fill_uninitialized_memory = os.environ.get(FILL_UNINITIALIZED_ENV) == "1"


@contextmanager
def determinism_restored():
    """Puts back, on leaving, the global switches `set_determinism` sets: what runs after a miniverl
    run in the same process (the bench's TRL sides) runs as it would alone (TRL's IW-OPD calls a
    float cumsum on CUDA, which strict deterministic mode refuses)."""
    cuda, cudnn = torch.backends.cuda, torch.backends.cudnn
    strict = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    fill, flash_env = torch.utils.deterministic.fill_uninitialized_memory, os.environ.get(FLASH_DETERMINISTIC_ENV)
    flags = (cudnn.benchmark, cudnn.deterministic, cuda.matmul.allow_tf32, cudnn.allow_tf32)
    backends = {
        name: getattr(cuda, f"{name}_sdp_enabled")() for name in SDP_BACKENDS if hasattr(cuda, f"{name}_sdp_enabled")
    }
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(strict[0], warn_only=strict[1])
        torch.utils.deterministic.fill_uninitialized_memory = fill
        cudnn.benchmark, cudnn.deterministic, cuda.matmul.allow_tf32, cudnn.allow_tf32 = flags
        for name, on in backends.items():
            getattr(cuda, f"enable_{name}_sdp")(on)
        if flash_env is None:
            os.environ.pop(FLASH_DETERMINISTIC_ENV, None)
        else:
            os.environ[FLASH_DETERMINISTIC_ENV] = flash_env


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


# oneDNN runs torch's bfloat16 GEMMs on the CPU and may be capped below the CPU's ISA
# (ONEDNN_MAX_CPU_ISA, formerly DNNL_MAX_CPU_ISA): capped below AVX512_CORE_BF16 it cannot use the
# bf16 instructions, and its bf16 GEMM is the slow path of a CPU without them (measured on an AMX
# Xeon: 6x slower capped at AVX2). What each cap leaves of them; a value oneDNN does not know, it
# ignores, and so does this table.
ONEDNN_BF16_CAPS = {
    **dict.fromkeys(("SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI")),
    **dict.fromkeys(("AVX512_CORE_BF16", "AVX512_CORE_FP16", "AVX10_1_512", "AVX10_2_512"), "avx512_bf16"),
    **dict.fromkeys(
        ("AVX512_CORE_AMX", "AVX512_CORE_AMX_FP16", "AVX10_1_512_AMX", "AVX10_1_512_AMX_FP16", "AVX10_2_512_AMX_2"),
        "amx",
    ),
}
BF16_KINDS = (None, "avx512_bf16", "amx")  # weakest first


def onednn_isa_cap() -> str | None:
    """The oneDNN ISA cap set in the environment (upper case), or None when there is none."""
    value = os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA")
    return value.strip().upper() if value and value.strip() else None


@functools.cache  # asked by every role, the plan and the report; the CPU does not change
def cpu_bf16_instructions() -> str | None:
    """The bfloat16 matrix instructions torch's GEMMs may use here: "amx" (AMX tiles, with
    AVX512-BF16), "avx512_bf16", or None (AVX2 and AVX-512 parts without them, or oneDNN capped
    below them). The CPU by torch's own detection, else /proc/cpuinfo; then oneDNN's cap."""
    found = _cpu_bf16_instructions()
    cap = onednn_isa_cap()
    if cap not in ONEDNN_BF16_CAPS:  # none, ALL, or a value oneDNN ignores
        return found
    return min(found, ONEDNN_BF16_CAPS[cap], key=BF16_KINDS.index)


def _cpu_bf16_instructions() -> str | None:
    probes = (
        ("amx", "_is_amx_tile_supported", "amx_bf16"),
        ("avx512_bf16", "_is_avx512_bf16_supported", "avx512_bf16"),
    )
    flags = None
    for name, probe, flag in probes:
        detect = getattr(torch.cpu, probe, None)
        if detect is not None:
            if detect():
                return name
            continue
        if flags is None:
            try:
                with open("/proc/cpuinfo", encoding="utf-8") as handle:
                    flags = set(next((line for line in handle if line.startswith("flags")), "").split())
            except OSError:
                flags = set()
        if flag in flags:
            return name
    return None


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
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        )
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
        "cpu_bf16_instructions": cpu_bf16_instructions(),
        "cpu_count": os.cpu_count(),
        "cuda_runtime": torch.version.cuda if cuda else None,
        "device": device.type,
        "driver": nvidia_driver() if cuda else None,
        "gpu": props.name if cuda else None,
        "gpu_count": torch.cuda.device_count() if cuda else 0,
        "onednn_max_cpu_isa": onednn_isa_cap(),
        "peft": package_version("peft"),
        "torch": torch.__version__,
        # bf16 sums round by how they are split over threads: the run computed with this count
        "torch_threads": torch.get_num_threads(),
        "transformers": package_version("transformers"),
        "vram_gib": round(props.total_memory / GIB, 3) if cuda else None,
    }
