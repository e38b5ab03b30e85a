"""Determinism switches: strict deterministic kernels and the math attention backend on CUDA
(checked on the CPU by recording what set_determinism switches), and on a GPU, bitwise-equal
attention gradients."""

from __future__ import annotations

import pytest
import torch

from miniverl.utils import device as device_module
from miniverl.utils.device import set_determinism

SDP_SWITCHES = ("enable_flash_sdp", "enable_mem_efficient_sdp", "enable_cudnn_sdp", "enable_math_sdp")


@pytest.fixture
def switches(monkeypatch):
    """Records every switch set_determinism flips, leaving this process's torch settings alone."""
    calls: dict[str, object] = {}
    for name in SDP_SWITCHES:
        monkeypatch.setattr(torch.backends.cuda, name, lambda on, name=name: calls.__setitem__(name, on), raising=False)
    monkeypatch.setattr(
        torch,
        "use_deterministic_algorithms",
        lambda mode, *, warn_only=False: calls.__setitem__("deterministic", (mode, warn_only)),
    )
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    monkeypatch.setattr(torch.utils.deterministic, "fill_uninitialized_memory", True)  # torch's default
    monkeypatch.delenv(device_module.FILL_UNINITIALIZED_ENV, raising=False)
    # torch.backends' flags are properties monkeypatch cannot undo: restored by hand.
    flags = [
        (torch.backends.cudnn, "benchmark"),
        (torch.backends.cudnn, "deterministic"),
        (torch.backends.cudnn, "allow_tf32"),
        (torch.backends.cuda.matmul, "allow_tf32"),
    ]
    saved = [getattr(module, attr) for module, attr in flags]
    yield calls
    for (module, attr), value in zip(flags, saved):
        setattr(module, attr, value)


def test_on_cuda_attention_runs_on_the_math_backend_only_with_strict_determinism(switches):
    torch.backends.cudnn.benchmark = True
    torch.backends.cuda.matmul.allow_tf32 = True
    set_determinism(torch.device("cuda", 0), True)  # only switches are set: no GPU needed
    assert switches == {
        "enable_flash_sdp": False,
        "enable_mem_efficient_sdp": False,
        "enable_cudnn_sdp": False,
        "enable_math_sdp": True,
        "deterministic": (True, False),
    }
    assert device_module.os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert torch.backends.cudnn.benchmark is False and torch.backends.cudnn.deterministic is True
    assert torch.backends.cuda.matmul.allow_tf32 is False and torch.backends.cudnn.allow_tf32 is False


def test_on_cuda_flash_attention_is_asked_for_its_deterministic_backward(switches, monkeypatch):
    """transformers runs flash-attn's deterministic backward only where FLASH_ATTENTION_DETERMINISTIC=1
    (a CUDA review: attn_implementation=flash_attention_2 broke exact resume without a word)."""
    monkeypatch.setenv(device_module.FLASH_DETERMINISTIC_ENV, "0")
    set_determinism(torch.device("cuda", 0), True)
    assert device_module.os.environ[device_module.FLASH_DETERMINISTIC_ENV] == "1"


def test_the_switches_set_determinism_sets_are_put_back_on_leaving_determinism_restored(monkeypatch):
    """bench --quality runs miniverl, then TRL, in one process: TRL's sides must not inherit the strict
    mode (on CUDA, TRL's IW-OPD's float cumsum raises there) nor the math-only attention."""
    from miniverl.utils.device import determinism_restored

    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    monkeypatch.delenv(device_module.FLASH_DETERMINISTIC_ENV, raising=False)
    cuda, cudnn = torch.backends.cuda, torch.backends.cudnn

    def switches_now():
        return (
            torch.are_deterministic_algorithms_enabled(),
            torch.utils.deterministic.fill_uninitialized_memory,
            cudnn.benchmark,
            cudnn.deterministic,
            cuda.matmul.allow_tf32,
            cudnn.allow_tf32,
            cuda.flash_sdp_enabled(),
            cuda.mem_efficient_sdp_enabled(),
            cuda.math_sdp_enabled(),
            device_module.os.environ.get(device_module.FLASH_DETERMINISTIC_ENV),
        )

    cudnn.benchmark = True  # a user's own setting before the run
    try:
        before = switches_now()
        with determinism_restored():
            set_determinism(torch.device("cuda", 0), True)  # only switches are set: no GPU needed
            assert switches_now() != before and torch.are_deterministic_algorithms_enabled()
        assert switches_now() == before
    finally:
        cudnn.benchmark = False


def test_a_cublas_workspace_torch_rejects_is_replaced_and_one_it_accepts_is_kept(switches, monkeypatch):
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":1:1")
    set_determinism(torch.device("cuda", 0), True)
    assert device_module.os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    set_determinism(torch.device("cuda", 0), True)
    assert device_module.os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"


def test_on_the_cpu_determinism_is_strict_and_attention_backends_are_left_alone(switches):
    set_determinism(torch.device("cpu"), True)
    assert switches == {"deterministic": (True, False)}
    assert "CUBLAS_WORKSPACE_CONFIG" not in device_module.os.environ


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_strict_determinism_does_not_fill_new_tensors_with_nan_unless_asked(switches, device, monkeypatch):
    set_determinism(torch.device(device), True)
    assert torch.utils.deterministic.fill_uninitialized_memory is False
    monkeypatch.setenv(device_module.FILL_UNINITIALIZED_ENV, "1")
    set_determinism(torch.device(device), True)
    assert torch.utils.deterministic.fill_uninitialized_memory is True


def test_hardware_deterministic_false_changes_nothing(switches):
    set_determinism(torch.device("cuda", 0), False)
    assert switches == {} and "CUBLAS_WORKSPACE_CONFIG" not in device_module.os.environ
    assert torch.utils.deterministic.fill_uninitialized_memory is True


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_sdpa_gradients_are_bitwise_equal_across_two_runs_on_cuda():
    cuda = torch.device("cuda")
    before = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        *(getattr(torch.backends.cuda, f"{n}_sdp_enabled")() for n in ("flash", "mem_efficient", "math")),
    )
    try:
        set_determinism(cuda, True)
        generator = torch.Generator(device=cuda).manual_seed(0)
        # (batch, heads, L, head_dim): long enough that a fused kernel would split the work.
        q, k, v = (torch.randn(2, 8, 512, 64, device=cuda, dtype=torch.bfloat16, generator=generator) for _ in range(3))
        upstream = torch.randn(2, 8, 512, 64, device=cuda, dtype=torch.bfloat16, generator=generator)

        def gradients():
            leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
            out = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=True)
            out.backward(upstream)
            return [t.grad for t in leaves]

        first, second = gradients(), gradients()
        for a, b in zip(first, second):
            assert torch.equal(a.view(torch.int16), b.view(torch.int16))  # bit for bit, NaNs included
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        for name, on in zip(("flash", "mem_efficient", "math"), before[2:]):
            getattr(torch.backends.cuda, f"enable_{name}_sdp")(on)


@pytest.mark.parametrize(
    ("cap", "found", "expected"),
    [
        (None, "amx", "amx"),
        ("AVX2", "amx", None),
        ("avx512_core", "amx", None),  # AVX-512 without its bf16 instructions
        ("AVX512_CORE_BF16", "amx", "avx512_bf16"),
        ("AVX512_CORE_AMX", "avx512_bf16", "avx512_bf16"),  # a cap cannot add instructions
        ("ALL", "amx", "amx"),
        ("AVX2", None, None),
    ],
)
def test_the_bf16_instructions_are_the_cpus_within_onednns_isa_cap(monkeypatch, cap, found, expected):
    """oneDNN runs torch's bf16 GEMMs: capped below AVX512_CORE_BF16 it cannot use the instructions,
    so every role must take the float32 products, as on a CPU without them."""
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    if cap is None:
        monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    else:
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", cap)
    monkeypatch.setattr(device_module, "_cpu_bf16_instructions", lambda: found)
    device_module.cpu_bf16_instructions.cache_clear()
    try:
        assert device_module.cpu_bf16_instructions() == expected
        assert device_module.hardware_facts(torch.device("cpu"))["onednn_max_cpu_isa"] == (cap.upper() if cap else None)
    finally:
        device_module.cpu_bf16_instructions.cache_clear()  # the next caller sees this machine again


@pytest.mark.parametrize("preset", ["auto", "rtx4080_16gb"])
def test_cuda_without_a_gpu_names_the_device_setting_and_the_cpu_fix(monkeypatch, preset):
    from miniverl.config.hardware import HardwareConfig
    from miniverl.utils.errors import MiniverlError

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(MiniverlError) as refused:
        device_module.resolve_device(HardwareConfig(name=preset, device="cuda"))
    line = str(refused.value)
    assert line.startswith(f"hardware.device=cuda (hardware={preset}) needs CUDA, but torch sees no GPU")
    assert line.endswith("run on the CPU with hardware=cpu and no hardware.device override")


def test_the_hardware_block_records_the_thread_count_the_run_computed_with():
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert device_module.hardware_facts(torch.device("cpu"))["torch_threads"] == 1
    finally:
        torch.set_num_threads(before)
