"""The kernel environment of a process: what besides the plan decides how it rounds, which every
checkpoint records (state.json's `numerics_environment`), and the resume's check of it: a process that
computes otherwise is refused in one line, or with trainer.resume_inexact goes on, said so."""

from __future__ import annotations

import os

import torch

from miniverl.utils.device import cpu_bf16_instructions, onednn_isa_cap, package_version
from miniverl.utils.errors import MiniverlError

# What besides the plan decides how this process rounds: the kernels torch runs and how they split
# their sums. Another thread count splits a CPU GEMM's sums otherwise; another ATen or oneDNN ISA, CPU,
# GPU or package release runs other kernels. A resume under any of them samples other tokens within an
# update or two (the real recipe resumed with 1 thread instead of 2: 20 of 192 tokens differed in the
# first update after the checkpoint, 187 in the second), so checkpoints record them
# (numerics_changes below).
NUMERICS_PACKAGES = ("torch", "transformers", "peft", "bitsandbytes")
NUMERICS_FIELD = "numerics_environment"  # state.json's record of it
# MKL runs torch's float32 GEMMs on x86 and may be capped too: MKL_ENABLE_INSTRUCTIONS=AVX2 on an AVX-512
# CPU gives other bits for the same F.linear (measured: a 4 x 576 by 49,152 x 576 product). Recorded only
# when set, so that the record (and the NF4 cache's key) of an uncapped process is as before. fbgemm's cap
# (FBGEMM_ENABLE_INSTRUCTIONS) gave the same bits for the float16 head's product: not recorded.
MKL_CAP = "MKL_ENABLE_INSTRUCTIONS"


def numerics_environment(device: torch.device) -> dict:
    """This process's kernel environment on `device`: on the CPU the torch threads, ATen's and oneDNN's
    ISA (and MKL's, where capped) and the CPU's bf16 instructions; on CUDA the GPU (the CPU's threads
    compute nothing there); and the packages that compute on both."""
    if device.type == "cuda":
        found = {"gpu": torch.cuda.get_device_name(device)}
    else:
        found = {
            "torch_threads": torch.get_num_threads(),
            "aten_cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "onednn_max_cpu_isa": onednn_isa_cap(),
            "cpu_bf16_instructions": cpu_bf16_instructions(),
        }
        if os.environ.get(MKL_CAP, "").strip():
            found["mkl_enable_instructions"] = os.environ[MKL_CAP].strip().upper()
    return {"device": device.type, **found, **{name: package_version(name) for name in NUMERICS_PACKAGES}}


def refused_numerics(checkpoint, now: dict, inexact_ok: bool) -> list[str]:
    """How this process (`now`) computes otherwise than the one that wrote `checkpoint` (a
    utils/checkpoint.Checkpoint); refused in one line unless `inexact_ok` (trainer.resume_inexact)."""
    before = checkpoint.state.get(NUMERICS_FIELD)
    changes = numerics_changes(before, now)
    if changes and not inexact_ok:
        raise MiniverlError(
            f"checkpoint {checkpoint.path} was written by a process that computes otherwise than this one "
            f"({'; '.join(changes)}): resumed here, the run would not go on byte for byte as the one that "
            f"stopped; resume {' and '.join(numerics_hints(before, now))}, or add trainer.resume_inexact=true "
            "to go on anyway (the report then says the resume is inexact)"
        )
    return changes


def numerics_changes(before: dict | None, now: dict) -> list[str]:
    """Each field of the kernel environment that differs, as "name before -> now"; none for a checkpoint
    written before miniverl recorded it."""
    if not before:
        return []
    return [
        f"{key} {before.get(key)} -> {now.get(key)}"
        for key in sorted(before.keys() | now.keys())
        if before.get(key) != now.get(key)
    ]


def numerics_hints(before: dict, now: dict) -> list[str]:
    """How to compute as the process that wrote a checkpoint did, one hint per differing field."""
    hints = []
    for key in sorted(before.keys() | now.keys()):
        was = before.get(key)
        if was == now.get(key):
            continue
        if key == "torch_threads":
            hints.append(f"with OMP_NUM_THREADS={was}")
        elif key == "aten_cpu_capability":
            hints.append(f"with ATEN_CPU_CAPABILITY={str(was).lower()}")
        elif key == "onednn_max_cpu_isa":
            hints.append(
                f"with ONEDNN_MAX_CPU_ISA={was}" if was else "without ONEDNN_MAX_CPU_ISA (or DNNL_MAX_CPU_ISA)"
            )
        elif key == "mkl_enable_instructions":
            hints.append(f"with {MKL_CAP}={was}" if was else f"without {MKL_CAP}")
        elif key == "cpu_bf16_instructions" and before.get("onednn_max_cpu_isa") == now.get("onednn_max_cpu_isa"):
            hints.append(f"on a CPU with {was}" if was else "on a CPU without bf16 matrix instructions")
        elif key in ("device", "gpu"):
            hints.append(f"on {before.get('gpu') or 'the CPU'} (hardware.device={before.get('device')})")
        elif key in NUMERICS_PACKAGES:
            hints.append(f"with {key}=={was}")
    return list(dict.fromkeys(hints))
