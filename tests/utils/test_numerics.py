"""The kernel environment a checkpoint records: what changed, named, and how to compute as before."""

from __future__ import annotations

import torch

from miniverl.utils import numerics


def test_the_kernel_environment_names_what_changed_and_how_to_compute_as_before():
    before = {"device": "cpu", "torch_threads": 2, "aten_cpu_capability": "AVX512", "onednn_max_cpu_isa": None}
    before |= {"cpu_bf16_instructions": "avx512_bf16", "torch": "2.13.0+cpu", "peft": "0.21.2"}
    assert numerics.numerics_changes(before, dict(before)) == []
    assert numerics.numerics_changes(None, before) == []  # a checkpoint written before miniverl recorded it
    capped = before | {"aten_cpu_capability": "AVX2", "onednn_max_cpu_isa": "AVX2", "cpu_bf16_instructions": None}
    assert numerics.numerics_changes(before, capped) == [
        "aten_cpu_capability AVX512 -> AVX2",
        "cpu_bf16_instructions avx512_bf16 -> None",
        "onednn_max_cpu_isa None -> AVX2",
    ]
    # The ISA cap explains the bf16 instructions it hides: no hint to find another CPU.
    assert numerics.numerics_hints(before, capped) == [
        "with ATEN_CPU_CAPABILITY=avx512",
        "without ONEDNN_MAX_CPU_ISA (or DNNL_MAX_CPU_ISA)",
    ]
    elsewhere = before | {"cpu_bf16_instructions": "amx", "torch_threads": 8, "peft": "0.22.0"}
    assert numerics.numerics_hints(before, elsewhere) == [
        "on a CPU with avx512_bf16",
        "with peft==0.21.2",
        "with OMP_NUM_THREADS=2",
    ]


def test_an_mkl_cap_is_recorded_only_where_set_and_its_change_named(monkeypatch):
    """MKL_ENABLE_INSTRUCTIONS changes the bits of torch's float32 GEMMs (an AVX2 cap on an AVX-512 CPU);
    an uncapped process records nothing for it, so its record (and the NF4 cache's key) is as before."""
    monkeypatch.delenv("MKL_ENABLE_INSTRUCTIONS", raising=False)
    uncapped = numerics.numerics_environment(torch.device("cpu"))
    assert "mkl_enable_instructions" not in uncapped
    monkeypatch.setenv("MKL_ENABLE_INSTRUCTIONS", "avx2")
    capped = numerics.numerics_environment(torch.device("cpu"))
    assert capped == uncapped | {"mkl_enable_instructions": "AVX2"}
    assert numerics.numerics_changes(uncapped, capped) == ["mkl_enable_instructions None -> AVX2"]
    assert numerics.numerics_hints(uncapped, capped) == ["without MKL_ENABLE_INSTRUCTIONS"]
    assert numerics.numerics_hints(capped, uncapped) == ["with MKL_ENABLE_INSTRUCTIONS=AVX2"]
