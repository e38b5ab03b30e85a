"""`python -m miniverl.bench`: miniverl's OPD pieces side by side with what a user would pick
instead, in one process, on the same randomly initialised models and prompts (no downloads).

    python -m miniverl.bench [--scale toy|bench|mid|qwen3-0.6b-shape] [--path both|recipe|float32] [--out DIR]

Batch 4, 64 new tokens, LoRA r16 (alpha 32) on q_proj/v_proj, gradient checkpointing on the
student. Two paths, each with its own models:

- `recipe` (the default's headline, keys `recipe_*`): what `+recipe=opd_k1` runs. Random Qwen3
  models of the scale's shape are written in bfloat16 and loaded by miniverl's own
  `models.load_student` / `models.load_teacher`: NF4 student (bitsandbytes, bf16 compute,
  `prepare_model_for_kbit_training`, LoRA r16 on q/v, gradient checkpointing) and NF4 teacher;
- `float32` (extra rows, today's keys): the same shapes unquantized, float32 on the CPU
  (bfloat16 on CUDA).

On each path it measures

1. rollout tokens/s: miniverl's decode loop vs `model.generate(use_cache=True)` (batch 4) and vs
   one row at a time (`model.generate(use_cache=True)` per prompt, batch 1: what a simple
   trainer's rollout does); on the recipe path also vs the same loop on bitsandbytes' per-call
   dequantization (the dense copies' memory is reported);
2. sampled-token scoring by the teacher: time and peak memory vs
   `log_softmax(logits.float()).gather(...)` on the model's full logits;
3. one whole OPD update (rollout, teacher, update, whose forward also gives the old log-probs;
   k1 on the sampled token) vs one on-policy step of TRL's `DistillationTrainer` (beta=1: the
   full-vocabulary reverse KL, plus the entropy, at every response position of both models) and,
   on the recipe path, vs TRL's experimental `IWOPDTrainer` configured as k1 (`distillation_objective="iw_opd"`,
   `iw_opd_gamma=0`: the sampled-token k1 policy gradient, computed from both models' full
   logits) — the same models, batch, lengths and LoRA; TRL comes with the optional extra
   `pip install -e .[bench]`; without it those ratios are null, with the reason;
4. update positions/s vs a bare forward+backward of the same LoRA model
   (`model(..., labels=...).loss.backward()`).

It writes `bench.json` (ratios under stable keys, every measurement behind them, the machine) and
`bench.md` (the tables) to --out, and prints the tables. Each timing is the best of several
rounds once warm (a warm-up round of its own, or after a warm-up OPD step that ran the same
kernels), the methods interleaved round by round (timeit's convention: on a shared
machine the least disturbed run is the best estimate of a method's own cost; medians are kept in
bench.json too); peak memory is measured last (on the CPU from the process's peak RSS,
with glibc's mmap threshold pinned so that freed buffers leave the RSS; on CUDA from the
allocator's peak).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import ctypes
import gc
import io
import json
import logging
import os
import re
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

SCHEMA = "miniverl-bench/2"
PATHS = ("recipe", "float32")
PREFIX = {"recipe": "recipe_", "float32": ""}
# Each miniverl ÷ other. The float32 path keeps the keys it had (the no-KV-cache baseline and its
# `rollout_vs_no_cache` are gone: one row at a time replaces it); the recipe path's carry `recipe_`.
PATH_RATIO_KEYS = {
    "recipe": (
        "recipe_rollout_vs_hf_generate",
        "recipe_rollout_vs_per_call_dequantize",
        "recipe_rollout_vs_one_row_generate",
        "recipe_scoring_time_vs_naive",
        "recipe_scoring_peak_memory_vs_naive",
        "recipe_opd_step_vs_trl",
        "recipe_opd_step_vs_trl_k1",
        "recipe_update_vs_bare_fwd_bwd",
    ),
    "float32": (
        "rollout_vs_hf_generate",
        "rollout_vs_one_row_generate",
        "scoring_time_vs_naive",
        "scoring_peak_memory_vs_naive",
        "opd_step_vs_trl",
        "update_vs_bare_fwd_bwd",
    ),
}
RATIO_KEYS = (*PATH_RATIO_KEYS["recipe"], *PATH_RATIO_KEYS["float32"])
# Targets from the issues, for --scale bench on a 2-core CPU: (comparison, bound).
TARGETS = {
    "recipe_rollout_vs_hf_generate": (">=", 2.0),
    "recipe_opd_step_vs_trl": ("<=", 0.5),
    "rollout_vs_hf_generate": (">=", 1.5),
    "rollout_vs_one_row_generate": (">=", 3.0),
    "scoring_time_vs_naive": ("<=", 1.1),
    "scoring_peak_memory_vs_naive": ("<=", 0.25),
    "opd_step_vs_trl": ("<=", 0.5),
    "update_vs_bare_fwd_bwd": (">=", 0.8),
}

# Architecture presets (Qwen3). The vocabulary of `toy` is the toy tokenizer's (259). `repeats`:
# timed rounds on the float32 path, `recipe_repeats` on the recipe path (NF4 on the CPU is slow).
SCALES = {
    "toy": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "head_dim": 16,
        "vocab_size": None,
        "tie_word_embeddings": False,
        "max_position_embeddings": 1024,
        "repeats": 3,
        "recipe_repeats": 2,
    },
    "bench": {
        "hidden_size": 256,
        "intermediate_size": 768,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "vocab_size": 32768,
        "tie_word_embeddings": False,
        "max_position_embeddings": 1024,
        "repeats": 2,
        "recipe_repeats": 2,
    },
    "mid": {
        "hidden_size": 512,
        "intermediate_size": 1536,
        "num_hidden_layers": 8,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 64,
        "vocab_size": 32768,
        "tie_word_embeddings": False,
        "max_position_embeddings": 1024,
        "repeats": 3,
        "recipe_repeats": 2,
    },
    "qwen3-0.6b-shape": {
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
        "max_position_embeddings": 40960,
        "rope_theta": 1_000_000.0,
        "repeats": 3,
        "recipe_repeats": 2,
    },
}
RUN_KEYS = ("repeats", "recipe_repeats")
PROMPTS = (
    "What is 12 + 30?",
    "Name the three primary colours of light and say in one sentence why they are called primary.",
    "Write one sentence about the sea.",
    "Explain in two sentences what a key-value cache does in a transformer decoder, and why it saves time.",
)
BATCH, NEW_TOKENS = 4, 64
LORA = {"r": 16, "alpha": 32, "target_modules": ("q_proj", "v_proj")}
# DistillationTrainer(beta=1); IWOPDTrainer(iw_opd, gamma=0), the k1 row, on the recipe path only.
TRL_KINDS = {"recipe": ("full_vocab", "k1"), "float32": ("full_vocab",)}

log = logging.getLogger("miniverl.bench")


# ---------------------------------------------------------------------------------------------- setup
@dataclass
class Setup:
    path: str  # "recipe" or "float32"
    scale: str
    device: torch.device
    dtype: torch.dtype  # the weights' dtype as written (recipe: bfloat16, NF4 layers compute in it)
    tokenizer: object
    prompt_ids: list[list[int]]
    student: object  # PeftModel (LoRA r16 on q/v), gradient checkpointing on
    teacher: object  # frozen, another seed
    eos_id: int
    pad_id: int
    description: dict


def qwen3_config(scale: str, vocab: int, eos_id: int, pad_id: int, dtype: torch.dtype):
    from transformers import Qwen3Config

    shape = {k: v for k, v in SCALES[scale].items() if k not in RUN_KEYS}
    shape["vocab_size"] = shape["vocab_size"] or vocab
    config = Qwen3Config(
        **shape,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        bos_token_id=None,
        dtype={torch.float32: "float32", torch.bfloat16: "bfloat16"}[dtype],
    )
    config._attn_implementation = "sdpa"
    return config


def bench_tokenizer():
    from miniverl.models import toy

    tokenizer = toy.build_toy_tokenizer()
    tokenizer.padding_side = "left"
    prompt_ids = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"]
        for p in PROMPTS
    ]
    return tokenizer, prompt_ids


def random_qwen3(config, seed: int, device: torch.device, dtype: torch.dtype, eos_id: int, pad_id: int):
    from transformers import Qwen3ForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        with torch.device(device):
            model = Qwen3ForCausalLM(config).to(dtype)
    model.generation_config.eos_token_id = eos_id
    model.generation_config.pad_token_id = pad_id
    return model.eval()


def nonzero_lora_b(student) -> None:
    """A non-zero LoRA B, so that the adapter carries signal (the same draw on both paths)."""
    with torch.no_grad():
        for name, param in student.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.01, generator=torch.Generator(device=param.device).manual_seed(3))


def build_float32_setup(scale: str, device: torch.device, workdir: Path) -> Setup:
    """Unquantized models built in memory: float32 on the CPU, bfloat16 on CUDA."""
    from peft import LoraConfig, get_peft_model

    from miniverl.models.loading import quiet_loading

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tokenizer, prompt_ids = bench_tokenizer()
    eos_id, pad_id = tokenizer.eos_token_id, tokenizer.pad_token_id
    config = qwen3_config(scale, len(tokenizer), eos_id, pad_id, dtype)
    with quiet_loading():
        student, teacher = (random_qwen3(config, seed, device, dtype, eos_id, pad_id) for seed in (0, 1))
        student.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        student.enable_input_require_grads()
        lora = LoraConfig(
            r=LORA["r"],
            lora_alpha=LORA["alpha"],
            lora_dropout=0.0,
            target_modules=list(LORA["target_modules"]),
            task_type="CAUSAL_LM",
        )
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(2)
            student = get_peft_model(student, lora).eval()
        nonzero_lora_b(student)
    teacher.requires_grad_(False)
    # TRL's IWOPDTrainer loads the teacher's tokenizer from the teacher's folder.
    tokenizer.save_pretrained(workdir / "tokenizer")
    teacher.config._name_or_path = str(workdir / "tokenizer")
    described = {
        "student": f"{str(dtype).replace('torch.', '')}, LoRA r{LORA['r']} on q/v, gradient checkpointing",
        "teacher": f"{str(dtype).replace('torch.', '')}, frozen, another seed",
        "quantization": None,
    }
    return Setup("float32", scale, device, dtype, tokenizer, prompt_ids, student, teacher, eos_id, pad_id, described)


def build_recipe_setup(scale: str, device: torch.device, workdir: Path) -> Setup:
    """What `+recipe=opd_k1` runs: bfloat16 checkpoints loaded by miniverl's own loaders (NF4 via
    bitsandbytes with bf16 compute, prepare_model_for_kbit_training, LoRA r16 alpha 32 on q/v,
    gradient checkpointing; the teacher NF4, frozen)."""
    from miniverl.config.model import LoraSettings, StudentConfig
    from miniverl.config.teacher import TeacherConfig
    from miniverl.models import loading as models

    tokenizer, prompt_ids = bench_tokenizer()
    eos_id, pad_id = tokenizer.eos_token_id, tokenizer.pad_token_id
    config = qwen3_config(scale, len(tokenizer), eos_id, pad_id, torch.bfloat16)
    folders = {}
    with models.quiet_loading():
        for name, seed in (("student", 0), ("teacher", 1)):
            model = random_qwen3(config, seed, torch.device("cpu"), torch.bfloat16, eos_id, pad_id)
            folders[name] = workdir / name
            model.save_pretrained(folders[name])
            tokenizer.save_pretrained(folders[name])
            del model
    lora = LoraSettings(r=LORA["r"], alpha=LORA["alpha"], dropout=0.0, target_modules=list(LORA["target_modules"]))
    student_block = StudentConfig(model_id=str(folders["student"]), dtype="auto", quantization="nf4", lora=lora)
    teacher_block = TeacherConfig(model_id=str(folders["teacher"]), dtype="auto", quantization="nf4")
    student = models.load_student(student_block, models.source_of(student_block, None), device, lora_seed=2)
    teacher = models.load_teacher(teacher_block, models.source_of(teacher_block, None), device)
    nonzero_lora_b(student)
    for model in (student.get_base_model(), teacher):
        model.generation_config.eos_token_id = eos_id
        model.generation_config.pad_token_id = pad_id
    described = {
        "student": "NF4 (bitsandbytes, bf16 compute) + prepare_model_for_kbit_training, "
        f"LoRA r{LORA['r']} on q/v, gradient checkpointing (models.load_student)",
        "teacher": "NF4 (bf16 compute), frozen, another seed (models.load_teacher)",
        "quantization": "nf4",
        "checkpoint_dtype": "bfloat16",
    }
    return Setup(
        "recipe", scale, device, torch.bfloat16, tokenizer, prompt_ids, student, teacher, eos_id, pad_id, described
    )


# ---------------------------------------------------------------------------------------------- measuring
def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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
        try:
            self.libc = ctypes.CDLL("libc.so.6")
        except OSError as error:
            self.reason = f"glibc not found ({error})"
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
            torch.cuda.empty_cache()
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


def response_tokens(completions: torch.Tensor, eos_id: int) -> int:
    """Tokens of (b, n) generated ids up to and including each row's first EOS."""
    is_eos = completions.eq(eos_id)
    first = torch.where(
        is_eos.any(1), is_eos.int().argmax(1) + 1, torch.full_like(is_eos[:, 0], completions.shape[1], dtype=torch.long)
    )
    return int(first.sum())


def four_bit_storage_bytes(model: torch.nn.Module) -> int:
    """Bytes of a model's bitsandbytes 4-bit weights as stored (packed weight + block scales)."""
    try:
        import bitsandbytes as bnb
    except ImportError:
        return 0
    total = 0
    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            weight, state = module.weight, module.weight.quant_state
            total += weight.data.numel() * weight.data.element_size()
            for tensor in (state.absmax, getattr(getattr(state, "state2", None), "absmax", None)):
                if tensor is not None:
                    total += tensor.numel() * tensor.element_size()
    return total


@contextmanager
def per_call_dequantize(worker):
    """The rollout on bitsandbytes' own per-call path (each 4-bit weight dequantized every call)."""
    previous = worker.dequantize_4bit_once
    worker.dequantize_4bit_once = False
    try:
        yield
    finally:
        worker.dequantize_4bit_once = previous


# ---------------------------------------------------------------------------------------------- the pieces
def products_in_float32(s: Setup, hw) -> bool:
    """Whether miniverl's roles multiply half-precision layers in float32 here (cpu_gemm.py): the
    in-house baselines (naive scoring, bare forward+backward) then do too, so that they differ from
    miniverl's roles only in what they are meant to; the peers (generate, TRL) run as shipped."""
    return hw.cpu_float32_gemm and s.device.type == "cpu"


def miniverl_workers(s: Setup, hw):
    from miniverl.config.actor import ActorConfig, RolloutConfig
    from miniverl.config.estimator import EstimatorConfig
    from miniverl.workers.actor import ActorWorker
    from miniverl.workers.rollout import RolloutWorker
    from miniverl.workers.teacher import TeacherWorker

    base = s.student.get_base_model()
    float32_gemm = products_in_float32(s, hw)
    rollout = RolloutWorker(
        base,
        RolloutConfig(),
        eos_ids=[s.eos_id],
        pad_id=s.pad_id,
        device=s.device,
        static_cache=hw.rollout_static_cache,
        compile_decode=hw.rollout_compile,
        cpu_gemv=hw.rollout_cpu_gemv,
        dequantize_4bit_once=hw.rollout_dequantize_4bit_once,
        float32_gemm=float32_gemm,
    )
    teacher_worker = TeacherWorker(s.teacher, logprob_chunk=hw.logprob_chunk, topk=None, float32_gemm=float32_gemm)

    def score(batch):
        return teacher_worker.compute_teacher_log_prob(batch, BATCH)

    k1 = EstimatorConfig(loss_mode="k1", use_policy_gradient=True, loss_max_clamp=10.0, log_prob_min_clamp=-10.0)
    actor = ActorWorker(
        s.student,
        ActorConfig(),
        k1,
        temperature=1.0,
        logprob_chunk=hw.logprob_chunk,
        loss_scale_factor=NEW_TOKENS,
        float32_gemm=float32_gemm,
    )
    return rollout, score, actor


def bench_rollout(s: Setup, rollout, repeats: int) -> tuple[dict, dict, object]:
    """miniverl's loop vs generate (batch 4) vs one row at a time; on the recipe path (CPU) also vs
    the same loop on bitsandbytes' per-call dequantization, with the same seeds round by round."""
    from miniverl.workers.rollout import left_pad

    ids, mask = left_pad(s.prompt_ids, s.pad_id, s.device)
    base = s.student.get_base_model()
    round_of = {}  # method -> calls so far: the same seeds for the same round of every method
    batches = {"miniverl": [], "miniverl_per_call_dequantize": []}
    held = []

    def ours(name: str):
        def run():
            n = round_of[name] = round_of.get(name, -1) + 1
            seeds = [1000 * n + i for i in range(BATCH)]
            context = (
                per_call_dequantize(rollout) if name == "miniverl_per_call_dequantize" else contextlib.nullcontext()
            )
            with context:
                batch = rollout.generate_sequences(
                    s.prompt_ids, list(range(BATCH)), seeds, response_limit=NEW_TOKENS, physical_batches=[BATCH]
                )
            if name == "miniverl":
                held.append(rollout.dequantized_bytes)
            batches[name].append(batch)
            return int(batch.response_mask.sum())

        return run

    def sample_kwargs(name: str) -> dict:
        n = round_of[name] = round_of.get(name, -1) + 1
        torch.manual_seed(10_000 + n)
        return {
            "do_sample": True,
            "max_new_tokens": NEW_TOKENS,
            "use_cache": True,
            "temperature": 1.0,
            "top_k": 0,
            "top_p": 1.0,
            "eos_token_id": s.eos_id,
            "pad_token_id": s.pad_id,
        }

    def hf_generate():
        s.student.eval()
        with torch.no_grad():
            out = base.generate(input_ids=ids, attention_mask=mask, **sample_kwargs("hf_generate"))
        return response_tokens(out[:, ids.shape[1] :], s.eos_id)

    def one_row_generate():  # each prompt alone, batch 1, KV cache: a simple trainer's rollout
        s.student.eval()
        kwargs, tokens = sample_kwargs("one_row_generate"), 0
        with torch.no_grad():
            for prompt in s.prompt_ids:
                row = torch.tensor([prompt], dtype=torch.long, device=s.device)
                out = base.generate(input_ids=row, attention_mask=torch.ones_like(row), **kwargs)
                tokens += response_tokens(out[:, row.shape[1] :], s.eos_id)
        return tokens

    methods = {"miniverl": ours("miniverl"), "hf_generate": hf_generate}
    four_bit = four_bit_storage_bytes(base)
    null_reasons = {}
    per_call_key = PREFIX[s.path] + "rollout_vs_per_call_dequantize"
    if s.path == "recipe":
        if s.device.type == "cpu":
            methods["miniverl_per_call_dequantize"] = ours("miniverl_per_call_dequantize")
        else:
            null_reasons[per_call_key] = "the rollout dequantizes each 4-bit weight once only on the CPU"
    fast = rounds(methods, s.device, repeats)
    # The slowest method: fewer rounds, no warm-up of its own (generate is warm by now).
    slow = rounds({"one_row_generate": one_row_generate}, s.device, max(1, min(2, repeats - 1)), warmup=0)
    result = {}
    for name, runs in {**fast, **slow}.items():
        rates = [tokens / sec for sec, tokens in runs]
        result[name] = {
            "tokens_per_s": round(max(rates), 2),
            "median_tokens_per_s": round(median(rates), 2),
            "runs": [[round(sec, 4), tokens] for sec, tokens in runs],
        }
    speed = {name: r["tokens_per_s"] for name, r in result.items()}
    prefix = PREFIX[s.path]
    ratios = {
        prefix + "rollout_vs_hf_generate": speed["miniverl"] / speed["hf_generate"],
        prefix + "rollout_vs_one_row_generate": speed["miniverl"] / speed["one_row_generate"],
    }
    result["miniverl"]["dequantized_bytes"] = max(held) if held else 0
    result["miniverl"]["four_bit_storage_bytes"] = four_bit
    if "miniverl_per_call_dequantize" in speed:
        ratios[per_call_key] = speed["miniverl"] / speed["miniverl_per_call_dequantize"]
        pairs = list(zip(batches["miniverl"], batches["miniverl_per_call_dequantize"]))
        result["miniverl"]["same_tokens_and_log_probs_as_per_call_dequantize"] = all(
            torch.equal(a.responses, b.responses) and torch.equal(a.rollout_log_probs, b.rollout_log_probs)
            for a, b in pairs
        )
    return {"measurements": result, "ratios": ratios, "null_reasons": null_reasons}, batches["miniverl"][-1]


def naive_teacher_log_probs(teacher, batch) -> torch.Tensor:
    P, R = batch.prompt_length, batch.response_length
    logits = teacher(
        input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids
    ).logits  # (B, L, V)
    return (
        torch.log_softmax(logits[:, P - 1 : P - 1 + R].float(), -1).gather(-1, batch.responses[..., None]).squeeze(-1)
    )


def bench_scoring_time(s: Setup, batch, hw, repeats: int) -> dict:
    from miniverl.models.cpu_gemm import float32_products
    from miniverl.workers.logprobs import response_log_probs

    float32_gemm = products_in_float32(s, hw)

    def ours():
        with torch.no_grad(), float32_products(s.teacher, float32_gemm):
            return response_log_probs(s.teacher, batch, chunk=hw.logprob_chunk)

    def naive():
        with torch.no_grad(), float32_products(s.teacher, float32_gemm):
            return naive_teacher_log_probs(s.teacher, batch)

    # No warm-up: the teacher has run in the warm-up OPD step; the naive path's first call only
    # adds its page faults, and the best of the rounds counts.
    runs = rounds({"miniverl": ours, "naive": naive}, s.device, repeats, warmup=0)
    mask = batch.response_mask
    diff = float(((runs["miniverl"][0][1] - runs["naive"][0][1]) * mask).abs().max())
    times = {name: best([sec for sec, _ in r]) for name, r in runs.items()}
    return {
        "measurements": {
            "positions": int(mask.numel()),
            "max_abs_diff_vs_naive": diff,
            **{f"{name}_seconds": round(t, 5) for name, t in times.items()},
            "runs": {name: [round(sec, 5) for sec, _ in r] for name, r in runs.items()},
        },
        "ratios": {PREFIX[s.path] + "scoring_time_vs_naive": times["miniverl"] / times["naive"]},
        "calls": {"miniverl": ours, "naive": naive},
    }


class OursOPDStep:
    """One whole miniverl OPD update (as trainer.fit_step): rollout, teacher, then the update, whose
    own forward gives the old log-probs (on-policy; see actor.py). Each instance records its own
    steps (one per TRL comparison); `count` is shared so that every step samples new seeds."""

    count = 0

    def __init__(self, s: Setup, rollout, score, actor):
        self.s, self.rollout, self.score, self.actor = s, rollout, score, actor
        self.steps, self.phases = [], []

    def __call__(self, record: bool = True) -> None:
        s, times = self.s, {}
        OursOPDStep.count += 1
        seeds = [5000 + 1000 * OursOPDStep.count + i for i in range(BATCH)]
        total, _ = seconds(lambda: self._step(seeds, times), s.device)
        if record:
            self.steps.append((total, int(times.pop("tokens"))))
            self.phases.append(times)

    def _step(self, seeds, times):
        s = self.s
        times["gen"], batch = seconds(
            lambda: self.rollout.generate_sequences(
                s.prompt_ids, list(range(BATCH)), seeds, response_limit=NEW_TOKENS, physical_batches=[BATCH]
            ),
            s.device,
        )
        times["teacher"], batch = seconds(lambda: self.score(batch), s.device)
        times["update_actor"], _ = seconds(lambda: self.actor.update_actor(batch, [BATCH]), s.device)
        times["tokens"] = float(batch.response_mask.sum())

    def summary(self) -> dict | None:
        if not self.steps:
            return None
        return {
            "step_seconds": [round(sec, 4) for sec, _ in self.steps],
            "best_step_seconds": round(best([sec for sec, _ in self.steps]), 4),
            "median_step_seconds": round(median([sec for sec, _ in self.steps]), 4),
            "response_tokens": [tokens for _, tokens in self.steps],
            "median_phase_seconds": {k: round(median([p[k] for p in self.phases]), 4) for k in self.phases[0]},
        }


TRL_COMPUTES = {
    "full_vocab": "DistillationTrainer, beta=1: the full-vocabulary reverse KL (and the entropy) at every response "
    "position, from both models' lm_head over the whole vocabulary (chunked)",
    "k1": "experimental IWOPDTrainer, distillation_objective='iw_opd', iw_opd_gamma=0: the sampled-token k1 policy "
    "gradient, -log p(y) * (log q(y) - log p(y)), the same objective as miniverl's, computed from both models' "
    "full (B, L, V) logits and log-softmax",
}


def trl_trainer(kind: str, s: Setup, student, repeats: int, workdir: Path, callbacks: list):
    """TRL's trainer of `kind`, on-policy (it generates with model.generate), the same models,
    batch, lengths, sampling, LoRA and gradient checkpointing as miniverl's step."""
    from datasets import Dataset

    cuda = s.device.type == "cuda"
    common = {
        "per_device_train_batch_size": BATCH,
        "gradient_accumulation_steps": 1,
        "max_steps": repeats,
        "max_completion_length": NEW_TOKENS,
        "temperature": 1.0,
        "top_k": 0,
        "top_p": 1.0,
        "learning_rate": 1e-5,
        "lr_scheduler_type": "constant",
        "warmup_steps": 0,
        "weight_decay": 0.01,
        "max_grad_norm": 1.0,
        "gradient_checkpointing": True,
        "gradient_checkpointing_kwargs": {"use_reentrant": False},
        # The recipe path's NF4 layers compute in bf16 as loaded, the rest in float32, as for
        # miniverl: no autocast. The float32 path on CUDA holds bfloat16 weights: autocast on.
        "bf16": cuda and s.path == "float32" and s.dtype == torch.bfloat16,
        "use_cpu": not cuda,
        "seed": 0,
        "logging_strategy": "no",
        "save_strategy": "no",
        "report_to": "none",
        "disable_tqdm": True,
        "dataloader_num_workers": 0,
    }
    conversations = [[{"role": "user", "content": p}] for p in PROMPTS]
    if kind == "full_vocab":
        from trl import DistillationConfig, DistillationTrainer

        args = DistillationConfig(output_dir=str(workdir / "trl_full_vocab"), beta=1.0, shuffle_dataset=False, **common)
        return DistillationTrainer(
            model=student,
            teacher_model=s.teacher,
            args=args,
            train_dataset=Dataset.from_dict({"prompt": conversations}),
            processing_class=s.tokenizer,
            callbacks=callbacks,
        )
    from trl.experimental.iw_opd import IWOPDConfig, IWOPDTrainer

    args = IWOPDConfig(
        output_dir=str(workdir / "trl_k1"),
        distillation_objective="iw_opd",
        iw_opd_gamma=0.0,
        lmbda=1.0,
        max_length=1024,
        **common,
    )
    trainer = IWOPDTrainer(
        model=student,
        teacher_model=s.teacher,
        args=args,
        train_dataset=Dataset.from_dict({"messages": conversations}),
        processing_class=s.tokenizer,
        callbacks=callbacks,
    )
    # transformers counts the loss's tokens from the dataset's labels, before on-policy generation:
    # none for prompts only, and IWOPDTrainer (TRL 1.16) then divides by 0. Without the count it
    # takes the mean over the generated tokens (its own fallback).
    trainer.model_accepts_loss_kwargs = False
    return trainer


def bench_opd_step_trl(
    kind: str, s: Setup, student, repeats: int, workdir: Path, between: Callable[[], None]
) -> tuple[dict | None, str | None]:
    """`repeats` timed steps of TRL's trainer, each followed by `between()` (miniverl's step:
    interleaved, so a busy machine slows both alike). No warm-up step of its own: the kernels are
    warm from miniverl's warm-up step on the same models, and a first TRL step measured within the
    spread of the later ones here (docs/bench.md); the best of the steps counts."""
    try:
        import trl
        from transformers import TrainerCallback
    except ImportError as error:
        return None, f"TRL is not installed ({error}); install the optional extra: pip install -e .[bench]"

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.times, self.start, self.error = [], None, None

        def on_step_begin(self, args, state, control, **kwargs):
            synchronize(s.device)
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            synchronize(s.device)
            self.times.append(time.perf_counter() - self.start)
            try:
                between()
            except Exception as error:  # noqa: BLE001 — miniverl's own failure, raised below
                self.error = error
                control.should_training_stop = True

    timer = StepTimer()
    try:
        trainer = trl_trainer(kind, s, student, repeats, workdir, [timer])
        with contextlib.redirect_stdout(io.StringIO()):  # the Trainer prints its closing metrics
            trainer.train()
    except Exception as error:  # noqa: BLE001 — any failure of the peer is reported, not fatal
        if timer.error is not None:
            raise timer.error from None
        return None, f"TRL {trl.__version__} ({kind}) failed here: {type(error).__name__}: {error}"
    if timer.error is not None:
        raise timer.error
    if not timer.times:
        return None, "TRL ran no step"
    measured = timer.times
    return {
        "trl_version": trl.__version__,
        "computes": TRL_COMPUTES[kind],
        "step_seconds": [round(t, 4) for t in measured],
        "best_step_seconds": round(best(measured), 4),
        "median_step_seconds": round(median(measured), 4),
    }, None


def bench_update(s: Setup, actor, batch, repeats: int) -> dict:
    from miniverl.models.cpu_gemm import float32_products

    student = s.student
    labels = torch.full_like(batch.input_ids, -100)
    labels[:, batch.prompt_length :] = batch.responses.masked_fill(batch.response_mask == 0, -100)

    def ours():
        batch.old_log_probs = None  # as in the trainer: the update's own forward gives them
        actor.update_actor(batch, [BATCH])

    def bare():
        student.train()
        with float32_products(student, actor.float32_gemm):
            loss = student(
                input_ids=batch.input_ids,
                attention_mask=batch.attention_mask,
                position_ids=batch.position_ids,
                labels=labels,
            ).loss
            loss.backward()
        student.zero_grad(set_to_none=True)
        student.eval()

    # No warm-up: the OPD steps before have run every kernel of both.
    runs = rounds({"miniverl": ours, "bare_fwd_bwd": bare}, s.device, repeats, warmup=0)
    positions = int(batch.response_mask.numel())
    rates = {name: positions / best([sec for sec, _ in r]) for name, r in runs.items()}
    return {
        "measurements": {
            "positions": positions,
            **{f"{n}_positions_per_s": round(v, 2) for n, v in rates.items()},
            "runs": {n: [round(sec, 4) for sec, _ in r] for n, r in runs.items()},
        },
        "ratios": {PREFIX[s.path] + "update_vs_bare_fwd_bwd": rates["miniverl"] / rates["bare_fwd_bwd"]},
    }


def measure_path(s: Setup, hw, repeats: int, no_trl: bool, workdir: Path) -> dict:
    """Every timing of one path (peak memory comes later, after both paths' timings)."""
    prefix = PREFIX[s.path]
    # TRL trains its own copies: the same weights and LoRA, taken before any update.
    trl_students = {} if no_trl else {kind: copy.deepcopy(s.student) for kind in TRL_KINDS[s.path]}
    rollout, score, actor = miniverl_workers(s, hw)
    log.info("%s: rollout", s.path)
    rollout_result, batch = bench_rollout(s, rollout, repeats)
    OursOPDStep(s, rollout, score, actor)(record=False)  # warm-up (the teacher's forward too)
    log.info("%s: scoring", s.path)
    scoring = bench_scoring_time(s, batch, hw, repeats)
    null_reasons = dict(rollout_result["null_reasons"])
    ratios = {**rollout_result["ratios"], **scoring["ratios"]}
    steps = {}
    for kind in TRL_KINDS[s.path]:
        key = prefix + ("opd_step_vs_trl" if kind == "full_vocab" else "opd_step_vs_trl_k1")
        log.info("%s: OPD step vs TRL (%s)", s.path, kind)
        ours = OursOPDStep(s, rollout, score, actor)
        if no_trl:
            trl_result, reason = None, "skipped (--no-trl)"
        else:
            trl_result, reason = bench_opd_step_trl(kind, s, trl_students.pop(kind), repeats, workdir, between=ours)
            gc.collect()
        if reason:
            null_reasons[key] = reason
        while len(ours.steps) < repeats:  # without TRL (or if it stopped early)
            ours()
        ours_step = ours.summary()
        if trl_result:  # the medians' ratio too: the best-of ratio is the table's
            ours_step["median_ratio_vs_trl"] = round(
                ours_step["median_step_seconds"] / trl_result["median_step_seconds"], 4
            )
        ratios[key] = ours_step["best_step_seconds"] / trl_result["best_step_seconds"] if trl_result else None
        steps[kind] = {"miniverl": ours_step, "trl": trl_result}
    log.info("%s: update", s.path)
    update = bench_update(s, actor, score(batch), repeats)
    ratios.update(update["ratios"])
    return {
        "ratios": ratios,
        "null_reasons": null_reasons,
        "calls": scoring["calls"],
        "measurements": {
            "rollout": rollout_result["measurements"],
            "scoring": scoring["measurements"],
            "opd_step": steps,
            "update": update["measurements"],
        },
    }


# ---------------------------------------------------------------------------------------------- report
def verdict(key: str, value: float | None) -> str:
    if key not in TARGETS:
        return "—"
    if value is None:
        return "n/a"
    op, bound = TARGETS[key]
    return "yes" if (value >= bound if op == ">=" else value <= bound) else "no"


def mib(b: int | None) -> str:
    return f"{b / 2**20:.1f} MiB" if b is not None else "n/a"


def path_rows(result: dict, path: str) -> list[tuple[str, str, str, str | None, float | None]]:
    """(label, miniverl, other, ratio key or None, ratio) of one path's table."""
    m, r, prefix = result["measurements"][path], result["ratios"], PREFIX[path]
    ro, sc, up, step = m["rollout"], m["scoring"], m["update"], m["opd_step"]

    def tps(name: str) -> str:
        return f"{ro[name]['tokens_per_s']:.1f}" if name in ro else "n/a"

    def seconds_of(part: dict | None) -> str:
        return f"{part['best_step_seconds']:.3f} s" if part else "n/a"

    rows = [
        (
            "rollout tokens/s vs `model.generate(use_cache=True)`, batch 4",
            tps("miniverl"),
            tps("hf_generate"),
            prefix + "rollout_vs_hf_generate",
        )
    ]
    if path == "recipe":
        rows.append(
            (
                "rollout tokens/s vs the same loop on bitsandbytes' per-call dequantization (every token)",
                tps("miniverl"),
                tps("miniverl_per_call_dequantize"),
                "recipe_rollout_vs_per_call_dequantize",
            )
        )
    rows += [
        (
            "rollout tokens/s vs one row at a time (`generate(use_cache=True)`, batch 1, each prompt alone)",
            tps("miniverl"),
            tps("one_row_generate"),
            prefix + "rollout_vs_one_row_generate",
        ),
        (
            "teacher scoring time vs `log_softmax(logits.float()).gather`",
            f"{sc['miniverl_seconds']:.4f} s",
            f"{sc['naive_seconds']:.4f} s",
            prefix + "scoring_time_vs_naive",
        ),
        (
            "teacher scoring peak memory vs the same",
            mib(sc.get("miniverl_peak_bytes")),
            mib(sc.get("naive_peak_bytes")),
            prefix + "scoring_peak_memory_vs_naive",
        ),
        (
            (
                "one OPD update (k1 on the sampled token) vs TRL `DistillationTrainer` step (beta=1: full-vocabulary "
                "reverse KL + entropy at every response position, both models)"
            ),
            seconds_of(step["full_vocab"]["miniverl"]),
            seconds_of(step["full_vocab"]["trl"]),
            prefix + "opd_step_vs_trl",
        ),
        (
            "update positions/s vs bare forward+backward",
            f"{up['miniverl_positions_per_s']:.1f}",
            f"{up['bare_fwd_bwd_positions_per_s']:.1f}",
            prefix + "update_vs_bare_fwd_bwd",
        ),
    ]
    if "k1" in step:
        rows.insert(
            -1,
            (
                (
                    "one OPD update vs TRL as close to k1 as it goes: experimental `IWOPDTrainer` (`iw_opd`, "
                    "gamma=0: the same sampled-token k1 policy gradient, from both models' full logits)"
                ),
                seconds_of(step["k1"]["miniverl"]),
                seconds_of(step["k1"]["trl"]),
                prefix + "opd_step_vs_trl_k1",
            ),
        )
    out = [(label, ours, other, key, r.get(key)) for label, ours, other, key in rows]
    if path == "recipe" and ro["miniverl"]["four_bit_storage_bytes"]:
        held, stored = ro["miniverl"]["dequantized_bytes"], ro["miniverl"]["four_bit_storage_bytes"]
        out.insert(
            2,
            (
                (
                    "rollout memory: dense copies of the student's 4-bit weights while decoding (freed after) vs "
                    "their NF4 storage"
                ),
                mib(held),
                mib(stored),
                None,
                held / stored,
            ),
        )
    return out


PATH_TITLES = {
    "recipe": "Recipe path (what `+recipe=opd_k1` runs): NF4 student (bf16 compute, prepare_model_for_kbit_training, "
    "LoRA r16 on q/v, gradient checkpointing) and NF4 teacher, loaded by miniverl's own loaders",
    "float32": "Unquantized float32 models (bfloat16 on CUDA), the same shapes: extra rows",
}


def markdown(result: dict) -> str:
    s = result["settings"]
    lines = [
        (
            f"miniverl bench, scale `{result['scale']}` on {result['machine']['device_name']} "
            f"({result['machine']['torch_threads']} torch threads), batch {BATCH}, {NEW_TOKENS} new tokens, "
            f"LoRA r{LORA['r']} on q/v; `{result['command']}`"
        )
    ]
    for path in result["paths"]:
        lines += [
            "",
            f"{PATH_TITLES[path]} (best of {s['repeats'][path]} interleaved rounds):",
            "",
            "| measurement | miniverl | other | ratio (miniverl ÷ other) | target | met |",
            "|---|---|---|---|---|---|",
        ]
        for label, ours, other, key, value in path_rows(result, path):
            shown = f"{value:.2f}" if value is not None else "null"
            if key in TARGETS:
                op, bound = TARGETS[key]
                target = f"{'≥' if op == '>=' else '≤'} {bound}"
            else:
                target = "—"
            lines.append(f"| {label} | {ours} | {other} | {shown} | {target} | {verdict(key, value)} |")
    lines += [
        "",
        (
            "What each TRL row computes: `DistillationTrainer` (beta=1) the full-vocabulary reverse KL and "
            "the entropy at every response position of both models, miniverl the single-sample k1 on the "
            "sampled token; `IWOPDTrainer` with `iw_opd_gamma=0` the same sampled-token k1 policy gradient as "
            "miniverl, from both models' full (B, L, V) logits. `DistillationTrainer` itself has no sampled-token "
            "option: its loss is always the chunked full-vocabulary generalized JSD."
        ),
    ]
    if result["machine"]["device"] == "cpu" and s["hardware"]["cpu_float32_gemm"]:
        lines += [
            "",
            (
                "Kernels: miniverl's roles and its in-house baselines (naive scoring, bare forward+backward) "
                "multiply the bf16 layers as float32 GEMMs of the same bf16 operands, rounded to bf16 "
                "(`hardware.cpu_float32_gemm`, miniverl/cpu_gemm.py); `generate` and TRL run bitsandbytes' "
                "and PyTorch's bf16 products as shipped. On a CPU without bf16 instructions that choice "
                "alone is most of the recipe path's lead; on CUDA both sides run bf16 kernels. "
                "`--no-cpu-float32-gemm` measures miniverl on the shipped products too."
            ),
        ]
    for key, reason in result["null_reasons"].items():
        lines.append(f"\n`{key}` is null: {reason}")
    return "\n".join(lines) + "\n"


def machine_facts(device: torch.device) -> dict:
    from miniverl.utils.device import hardware_facts

    facts = hardware_facts(device)
    facts["torch_threads"] = torch.get_num_threads()
    facts["device_name"] = facts["gpu"] if device.type == "cuda" else f"{facts['cpu']} ({facts['cpu_count']} cores)"
    try:
        import trl

        facts["trl"] = trl.__version__
    except ImportError:
        facts["trl"] = None
    return facts


# ---------------------------------------------------------------------------------------------- main
@contextmanager
def quiet():
    import transformers

    previous = transformers.utils.logging.get_verbosity()
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        transformers.utils.logging.set_verbosity(previous)


def parse_args(argv: list[str]) -> argparse.Namespace:
    from miniverl.config.hardware import HardwareConfig

    defaults = HardwareConfig()
    p = argparse.ArgumentParser(prog="python -m miniverl.bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--scale", choices=sorted(SCALES), default="bench")
    p.add_argument(
        "--path",
        choices=("both", *PATHS),
        default="both",
        help="recipe: NF4 + LoRA as +recipe=opd_k1 (keys recipe_*); float32: unquantized (today's keys)",
    )
    p.add_argument("--out", default=None, help="output folder (default outputs/bench/<scale>)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument(
        "--repeats", type=int, default=None, help="timed rounds per measurement (default per scale and path)"
    )
    p.add_argument("--no-trl", action="store_true", help="skip TRL (the opd_step_vs_trl* ratios are then null)")
    p.add_argument("--logprob-chunk", type=int, default=defaults.logprob_chunk, help="hardware.logprob_chunk")
    p.add_argument(
        "--static-cache",
        action=argparse.BooleanOptionalAction,
        default=defaults.rollout_static_cache,
        help="hardware.rollout_static_cache",
    )
    p.add_argument(
        "--compile-decode",
        action=argparse.BooleanOptionalAction,
        default=defaults.rollout_compile,
        help="hardware.rollout_compile",
    )
    p.add_argument(
        "--cpu-gemv",
        action=argparse.BooleanOptionalAction,
        default=defaults.rollout_cpu_gemv,
        help="hardware.rollout_cpu_gemv",
    )
    p.add_argument(
        "--cpu-float32-gemm",
        action=argparse.BooleanOptionalAction,
        default=defaults.cpu_float32_gemm,
        help="hardware.cpu_float32_gemm (miniverl's roles and in-house baselines; never the peers)",
    )
    args = p.parse_args(argv)
    args.argv = list(argv)
    return args


def run(args: argparse.Namespace) -> dict:
    from miniverl.config.hardware import HardwareConfig

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no GPU")
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    hw = HardwareConfig(
        device=device.type,
        logprob_chunk=args.logprob_chunk,
        rollout_static_cache=args.static_cache,
        rollout_compile=args.compile_decode,
        rollout_cpu_gemv=args.cpu_gemv,
        cpu_float32_gemm=args.cpu_float32_gemm,
    )
    paths = PATHS if args.path == "both" else (args.path,)
    repeats = {
        path: args.repeats or SCALES[args.scale]["recipe_repeats" if path == "recipe" else "repeats"] for path in PATHS
    }
    out = Path(args.out or Path("outputs") / "bench" / args.scale)
    out.mkdir(parents=True, exist_ok=True)
    command = " ".join(["python -m miniverl.bench", *args.argv])
    started = time.perf_counter()
    memory = PeakMemory(device)
    ratios = dict.fromkeys(RATIO_KEYS)
    null_reasons, measured, setups = {}, {}, {}
    builders = {"recipe": build_recipe_setup, "float32": build_float32_setup}
    with quiet(), tempfile.TemporaryDirectory(dir=out) as workdir:
        for path in paths:
            folder = Path(workdir) / path
            folder.mkdir()
            log.info("%s: models", path)
            s = setups[path] = builders[path](args.scale, device, folder)
            measured[path] = measure_path(s, hw, repeats[path], args.no_trl, folder)
            ratios.update(measured[path]["ratios"])
            null_reasons.update(measured[path]["null_reasons"])
        log.info("peak memory")  # last: pinning glibc's mmap threshold slows allocation
        for path in paths:
            peaks = peak_memory(memory, measured[path]["calls"], rounds=2 if path == "recipe" else 3)
            measured[path]["measurements"]["scoring"].update(
                miniverl_peak_bytes=peaks["miniverl"], naive_peak_bytes=peaks["naive"]
            )
            key = PREFIX[path] + "scoring_peak_memory_vs_naive"
            ratios[key] = peaks["miniverl"] / peaks["naive"] if peaks["naive"] else None
            if memory.reason:
                null_reasons[key] = memory.reason
    for path in PATHS:
        if path not in paths:
            null_reasons.update(dict.fromkeys(PATH_RATIO_KEYS[path], f"not measured (--path {args.path})"))
    shape = {k: v for k, v in SCALES[args.scale].items() if k not in RUN_KEYS}
    shape["vocab_size"] = next(iter(setups.values())).student.get_base_model().config.vocab_size
    result = {
        "schema": SCHEMA,
        "command": command,
        "scale": args.scale,
        "paths": list(paths),
        "ratios": {k: (round(ratios[k], 4) if ratios[k] is not None else None) for k in RATIO_KEYS},
        "targets": {k: f"{op} {bound}" for k, (op, bound) in TARGETS.items()},
        "null_reasons": null_reasons,
        "settings": {
            "batch": BATCH,
            "new_tokens": NEW_TOKENS,
            "lora": {**LORA, "target_modules": list(LORA["target_modules"])},
            "student_gradient_checkpointing": True,
            "repeats": {p: repeats[p] for p in paths},
            "shape": shape,
            "models": {p: setups[p].description for p in paths},
            "trl": TRL_COMPUTES,
            "hardware": {
                "logprob_chunk": hw.logprob_chunk,
                "rollout_static_cache": hw.rollout_static_cache,
                "rollout_compile": hw.rollout_compile,
                "rollout_cpu_gemv": hw.rollout_cpu_gemv,
                "rollout_dequantize_4bit_once": hw.rollout_dequantize_4bit_once,
                "cpu_float32_gemm": hw.cpu_float32_gemm,
            },
            "prompt_tokens": [len(p) for p in next(iter(setups.values())).prompt_ids],
        },
        "measurements": {p: measured[p]["measurements"] for p in paths},
        "machine": machine_facts(device),
        "bench_seconds": round(time.perf_counter() - started, 2),
    }
    (out / "bench.json").write_text(json.dumps(result, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    table = markdown(result)
    (out / "bench.md").write_text(table, encoding="utf-8")
    print(table)
    print(f"wrote {out / 'bench.json'} and {out / 'bench.md'} ({result['bench_seconds']} s)")
    return result


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    run(parse_args(sys.argv[1:] if argv is None else argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
