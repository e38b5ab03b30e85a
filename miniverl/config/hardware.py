"""Schema of `conf/hardware/`: where the run executes and how work is split on that device."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from miniverl.config.bounds import check_range

DEVICES = ("auto", "cpu", "cuda")


@dataclass
class HardwareConfig:
    # The name of this hardware option (conf/hardware/<name>.yaml), recorded in the report.
    name: str = "auto"
    device: str = "auto"  # auto = CUDA when present, else the CPU
    # Rows per rollout forward (the "physical" batch of a logical batch).
    rollout_physical_batch: int = 4
    # Rows per actor forward/backward (verl: ppo_micro_batch_size_per_gpu); gradients accumulate.
    update_chunk: int = 4
    # Positions per chunk when turning hidden states into sampled-token log-probs, so that no
    # (B, T, V) float32 tensor is ever materialised at once; a chunk also never holds more than
    # 2**24 logits (miniverl.workers.logprobs.MAX_CHUNK_ELEMENTS), whatever the vocabulary.
    logprob_chunk: int = 64
    deterministic: bool = True  # deterministic kernels where the device offers them
    # Rollout decode loop (miniverl/workers/rollout/, docs/bench.md). A preallocated KV cache, reused
    # across rollouts, instead of one that grows by concatenation.
    rollout_static_cache: bool = False
    # Compile the per-step decoder call (torch.compile; on CUDA mode "reduce-overhead", i.e. a
    # CUDA graph). Implies the static cache. Meant for CUDA; costs a compilation per batch shape.
    rollout_compile: bool = False
    # CPU only: while decoding, float32 linears of 2-8 rows (the lm_head included) as W @ x^T
    # instead of F.linear's x @ W^T (float rounding differs in the last bits; ignored on CUDA).
    # null: by the CPU — W @ x^T except on CPUs with AMX, where F.linear is the faster form
    # (measured: 1.5-4x faster as W @ x^T on an AVX2 EPYC; 1.3-3x slower on an AMX Xeon; docs/bench.md).
    rollout_cpu_gemv: Optional[bool] = None
    # CPU only: while decoding, each bitsandbytes 4-bit weight is dequantized once per physical
    # batch instead of on every call (the same values, bitwise); the dense copies are held during the
    # rollout (bf16: about 3.6x the NF4 storage, ~0.9 GB for a Qwen3-0.6B student; twice that in
    # float32 where every role multiplies in float32, cpu_float32_gemm) and freed after.
    rollout_dequantize_4bit_once: bool = True
    # CPU only, native bf16 products: while decoding, each dense copy above is reordered once per
    # physical batch into oneDNN's blocked layout for the decode step's rows, and layers that read
    # one input (q/k/v, gate/up) are stacked into one product, so that no product reorders its
    # weight again per call (bitwise the same products, checked per layer on entry; else the plain
    # copy). The prompt's prefill then dequantizes per call. Not with rollout_compile (true with it
    # is refused). null: where the CPU has bf16 instructions and the decode is not compiled (measured
    # on an AMX Xeon: docs/bench.md).
    rollout_cpu_prepack: Optional[bool] = None
    # CPU only: while decoding, a frozen float32 lm_head holding a bf16 checkpoint's values (upcast
    # by prepare_model_for_kbit_training) is read from a float16 copy that fbgemm multiplies in
    # float32, the values float16 cannot hold (below its normals: none of SmolLM2's, 0.017 % of a
    # 151,936-token head measured) from a sparse float32 residual: the step's largest product 1.7-2.5x
    # faster (measured), the same values, another summation order (log-probs within 2e-5 nats); the
    # copy (2 bytes a weight, each row padded to 512 values) is kept for the run; a head of float32
    # values (over 1 % outside float16) or with inf/NaN reads its own. null: where the CPU has bf16
    # instructions (measured there; true was faster under the AVX2 caps too, not yet measured on an
    # AVX2 machine: docs/bench.md).
    rollout_cpu_fp16_lm_head: Optional[bool] = None
    # CPU only: how every role (rollout, teacher, actor, probe, doctor) multiplies frozen
    # half-precision layers (NF4 layers with bf16 compute, a bf16 lm_head). true: as float32 GEMMs of
    # the same bf16 operands, rounded to bf16 (miniverl/models/cpu_gemm.py); false: torch's native
    # bf16 GEMM; null: by the CPU — native where it has bf16 instructions (AMX or AVX512-BF16;
    # measured 2-7x faster than float32 on AMX, AVX512-BF16 alone unmeasured), float32 elsewhere
    # (AVX2: bf16 GEMMs run 7-40x slower). docs/bench.md.
    cpu_float32_gemm: Optional[bool] = None
    # Quantize each NF4 model once per machine: the first load saves the quantized weights under
    # $MINIVERL_CACHE/nf4/ (a third to a half of the bf16 checkpoint's size, an entry per model folder,
    # compute dtype and device), later loads read them back instead of quantizing again (2.5 s of a
    # 135M model's 2.7 s on a CPU thread; the same bits, checked by sha256 on every read). Toys are
    # never cached. models/nf4_cache.py.
    nf4_cache: bool = True
    # Resource contract of this hardware option (null: no limit).
    gpu_hour_limit: Optional[float] = None
    # Resource contract: the most GPU memory the run may reserve (null: no limit); on CUDA the
    # pre-flight refuses a run estimated above it, on the CPU it is not read.
    peak_reserved_limit_gib: Optional[float] = None
    # Test only: fault injection, a forward of more rows than this raises torch.OutOfMemoryError,
    # exercising the out-of-memory downshift (null: off; leave it off).
    simulate_oom_above_rows: Optional[int] = None

    def __post_init__(self) -> None:
        if self.device not in DEVICES:
            raise ValueError(f"hardware.device={self.device!r}; choose one of {', '.join(DEVICES)}")
        for key in ("rollout_physical_batch", "update_chunk", "logprob_chunk"):
            check_range(f"hardware.{key}", getattr(self, key), at_least=1)
        check_range("hardware.gpu_hour_limit", self.gpu_hour_limit, above=0, null_ok=True)
        check_range("hardware.peak_reserved_limit_gib", self.peak_reserved_limit_gib, above=0, null_ok=True)
        check_range("hardware.simulate_oom_above_rows", self.simulate_oom_above_rows, at_least=0, null_ok=True)
        if self.rollout_cpu_prepack and self.rollout_compile:  # the compiled step reads the copies as they are
            raise ValueError(
                "hardware.rollout_cpu_prepack=true does not apply with hardware.rollout_compile=true; set "
                "rollout_cpu_prepack=false (or null: by the CPU, off when compiling) or rollout_compile=false"
            )
