"""`python -m miniverl.bench`: miniverl's OPD pieces side by side with what a user would pick
instead, in one process, on the same randomly initialised models and prompts (no downloads).

    python -m miniverl.bench [--scale toy|bench|qwen3-0.6b-shape] [--out DIR]

Batch 4, 64 new tokens, LoRA r16 (alpha 32) on q_proj/v_proj, gradient checkpointing on the
student (as the opd_k1 recipe). It measures

1. rollout tokens/s: miniverl's decode loop vs `model.generate(use_cache=True)` vs
   `model.generate(use_cache=False)` (what a model left in gradient-checkpointing train mode does);
2. sampled-token scoring by the teacher: time and peak memory vs
   `log_softmax(logits.float()).gather(...)` on the model's full logits;
3. one whole OPD update (rollout, teacher, update, whose forward also gives the old log-probs) vs
   one on-policy step of TRL's `DistillationTrainer` (beta=1, the same models, batch, lengths and
   LoRA) — TRL comes with the optional extra `pip install -e .[bench]`; without it that ratio is
   null, with the reason;
4. update positions/s vs a bare forward+backward of the same LoRA model
   (`model(..., labels=...).loss.backward()`).

It writes `bench.json` (ratios under stable keys, every measurement behind them, the machine) and
`bench.md` (the table) to --out, and prints the table. Each timing is the best of several rounds
after a warm-up, the methods interleaved round by round (timeit's convention: on a shared
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
import inspect
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
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

SCHEMA = "miniverl-bench/1"
RATIO_KEYS = ("rollout_vs_hf_generate", "rollout_vs_no_cache", "scoring_time_vs_naive",
              "scoring_peak_memory_vs_naive", "opd_step_vs_trl", "update_vs_bare_fwd_bwd")
# Targets from the issue, for --scale bench on a 2-core CPU: (comparison, bound).
TARGETS = {"rollout_vs_hf_generate": (">=", 1.5), "rollout_vs_no_cache": (">=", 5.0),
           "scoring_time_vs_naive": ("<=", 1.1), "scoring_peak_memory_vs_naive": ("<=", 0.25),
           "opd_step_vs_trl": ("<=", 0.5), "update_vs_bare_fwd_bwd": (">=", 0.8)}

# Architecture presets (Qwen3). The vocabulary of `toy` is the toy tokenizer's (259).
SCALES = {
    "toy": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=4, head_dim=16, vocab_size=None, tie_word_embeddings=False,
                max_position_embeddings=1024, repeats=3),
    "bench": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=64, vocab_size=32768, tie_word_embeddings=False,
                  max_position_embeddings=1024, repeats=5),
    "mid": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                num_key_value_heads=4, head_dim=64, vocab_size=32768, tie_word_embeddings=False,
                max_position_embeddings=1024, repeats=5),
    "qwen3-0.6b-shape": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                             num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True,
                             max_position_embeddings=40960, rope_theta=1_000_000.0, repeats=3),
}
PROMPTS = (
    "What is 12 + 30?",
    "Name the three primary colours of light and say in one sentence why they are called primary.",
    "Write one sentence about the sea.",
    "Explain in two sentences what a key-value cache does in a transformer decoder, and why it saves time.",
)
BATCH, NEW_TOKENS = 4, 64
LORA = dict(r=16, alpha=32, target_modules=("q_proj", "v_proj"))

log = logging.getLogger("miniverl.bench")


# ---------------------------------------------------------------------------------------------- setup
@dataclass
class Setup:
    scale: str
    device: torch.device
    dtype: torch.dtype
    tokenizer: object
    prompt_ids: list[list[int]]
    student: object  # PeftModel (LoRA r16 on q/v), gradient checkpointing on
    teacher: object  # frozen Qwen3ForCausalLM, another seed
    eos_id: int
    pad_id: int


def qwen3_config(scale: str, vocab: int, eos_id: int, pad_id: int, dtype: torch.dtype):
    from transformers import Qwen3Config
    shape = {k: v for k, v in SCALES[scale].items() if k != "repeats"}
    shape["vocab_size"] = shape["vocab_size"] or vocab
    config = Qwen3Config(**shape, eos_token_id=eos_id, pad_token_id=pad_id, bos_token_id=None,
                         dtype={torch.float32: "float32", torch.bfloat16: "bfloat16"}[dtype])
    config._attn_implementation = "sdpa"
    return config


def build_setup(scale: str, device: torch.device, dtype: torch.dtype) -> Setup:
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen3ForCausalLM

    from miniverl import toy
    from miniverl.models import quiet_loading

    tokenizer = toy.build_toy_tokenizer()
    tokenizer.padding_side = "left"
    eos_id, pad_id = tokenizer.eos_token_id, tokenizer.pad_token_id
    prompt_ids = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                                tokenize=True, return_dict=True)["input_ids"] for p in PROMPTS]
    config = qwen3_config(scale, len(tokenizer), eos_id, pad_id, dtype)
    models = []
    with quiet_loading():
        for seed in (0, 1):
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                with torch.device(device):
                    model = Qwen3ForCausalLM(config).to(dtype)
            model.generation_config.eos_token_id = eos_id
            model.generation_config.pad_token_id = pad_id
            models.append(model.eval())
        student, teacher = models
        student.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        student.enable_input_require_grads()
        lora = LoraConfig(r=LORA["r"], lora_alpha=LORA["alpha"], lora_dropout=0.0,
                          target_modules=list(LORA["target_modules"]), task_type="CAUSAL_LM")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(2)
            student = get_peft_model(student, lora).eval()
        with torch.no_grad():  # a non-zero B, so that the adapter carries signal
            for name, param in student.named_parameters():
                if "lora_B" in name:
                    param.normal_(0.0, 0.01, generator=torch.Generator(device=param.device).manual_seed(3))
    teacher.requires_grad_(False)
    return Setup(scale, device, dtype, tokenizer, prompt_ids, student, teacher, eos_id, pad_id)


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


def rounds(methods: dict[str, Callable[[], object]], device: torch.device, repeats: int,
           warmup: int = 1) -> dict[str, list[tuple[float, object]]]:
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
    first = torch.where(is_eos.any(1), is_eos.int().argmax(1) + 1, torch.full_like(is_eos[:, 0], completions.shape[1],
                                                                                      dtype=torch.long))
    return int(first.sum())


# ---------------------------------------------------------------------------------------------- the pieces
def miniverl_workers(s: Setup, hw):
    from miniverl.actor import ActorWorker
    from miniverl.rollout import RolloutWorker
    from miniverl.schema.actor import ActorConfig, RolloutConfig
    from miniverl.schema.estimator import EstimatorConfig
    from miniverl.teacher import TeacherWorker

    base = s.student.get_base_model()
    rollout = RolloutWorker(base, RolloutConfig(), eos_ids=[s.eos_id], pad_id=s.pad_id, device=s.device,
                            static_cache=hw.rollout_static_cache, compile_decode=hw.rollout_compile,
                            cpu_gemv=hw.rollout_cpu_gemv)
    params = inspect.signature(TeacherWorker.__init__).parameters
    if "rows_per_forward" in params:  # older TeacherWorker
        teacher_worker = TeacherWorker(s.teacher, rows_per_forward=BATCH, logprob_chunk=hw.logprob_chunk, topk=None)
        score = teacher_worker.compute_teacher_log_prob
    else:
        teacher_worker = TeacherWorker(s.teacher, logprob_chunk=hw.logprob_chunk, topk=None)
        score = lambda batch: teacher_worker.compute_teacher_log_prob(batch, BATCH)  # noqa: E731
    k1 = EstimatorConfig(loss_mode="k1", use_policy_gradient=True, loss_max_clamp=10.0, log_prob_min_clamp=-10.0)
    actor = ActorWorker(s.student, ActorConfig(), k1, temperature=1.0, logprob_chunk=hw.logprob_chunk,
                        loss_scale_factor=NEW_TOKENS)
    return rollout, score, actor


def bench_rollout(s: Setup, rollout, repeats: int) -> tuple[dict, object]:
    from miniverl.rollout import left_pad
    ids, mask = left_pad(s.prompt_ids, s.pad_id, s.device)
    base = s.student.get_base_model()
    counter = iter(range(10**9))
    batches = []

    def ours():
        seeds = [1000 * next(counter) + i for i in range(BATCH)]
        batch = rollout.generate_sequences(s.prompt_ids, list(range(BATCH)), seeds, response_limit=NEW_TOKENS,
                                           physical_batches=[BATCH])
        batches.append(batch)
        return int(batch.response_mask.sum())

    def hf(use_cache: bool):
        def run():
            s.student.eval()
            torch.manual_seed(next(counter))
            with torch.no_grad():
                out = base.generate(input_ids=ids, attention_mask=mask, do_sample=True, max_new_tokens=NEW_TOKENS,
                                    use_cache=use_cache, temperature=1.0, top_k=0, top_p=1.0, eos_token_id=s.eos_id,
                                    pad_token_id=s.pad_id)
            return response_tokens(out[:, ids.shape[1]:], s.eos_id)
        return run

    fast = rounds({"miniverl": ours, "hf_generate": hf(True)}, s.device, repeats)
    slow = rounds({"no_cache": hf(False)}, s.device, max(1, min(2, repeats)), warmup=0)
    result = {}
    for name, runs in {**fast, **slow}.items():
        rates = [tokens / sec for sec, tokens in runs]
        result[name] = {"tokens_per_s": round(max(rates), 2), "median_tokens_per_s": round(median(rates), 2),
                        "runs": [[round(sec, 4), tokens] for sec, tokens in runs]}
    ratios = {"rollout_vs_hf_generate": result["miniverl"]["tokens_per_s"] / result["hf_generate"]["tokens_per_s"],
              "rollout_vs_no_cache": result["miniverl"]["tokens_per_s"] / result["no_cache"]["tokens_per_s"]}
    return {"measurements": result, "ratios": ratios}, batches[-1]


def naive_teacher_log_probs(teacher, batch) -> torch.Tensor:
    P, R = batch.prompt_length, batch.response_length
    logits = teacher(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                     position_ids=batch.position_ids).logits  # (B, L, V)
    return torch.log_softmax(logits[:, P - 1:P - 1 + R].float(), -1).gather(-1, batch.responses[..., None]).squeeze(-1)


def bench_scoring_time(s: Setup, batch, hw, repeats: int) -> dict:
    from miniverl.logprobs import response_log_probs

    def ours():
        with torch.no_grad():
            return response_log_probs(s.teacher, batch, chunk=hw.logprob_chunk)

    def naive():
        with torch.no_grad():
            return naive_teacher_log_probs(s.teacher, batch)

    runs = rounds({"miniverl": ours, "naive": naive}, s.device, repeats)
    mask = batch.response_mask
    diff = float(((runs["miniverl"][0][1] - runs["naive"][0][1]) * mask).abs().max())
    times = {name: best([sec for sec, _ in r]) for name, r in runs.items()}
    return {"measurements": {"positions": int(mask.numel()), "max_abs_diff_vs_naive": diff,
                             **{f"{name}_seconds": round(t, 5) for name, t in times.items()},
                             "runs": {name: [round(sec, 5) for sec, _ in r] for name, r in runs.items()}},
            "ratios": {"scoring_time_vs_naive": times["miniverl"] / times["naive"]}, "calls": {"miniverl": ours, "naive": naive}}


class OursOPDStep:
    """One whole miniverl OPD update (as trainer.fit_step): rollout, teacher, then the update, whose
    own forward gives the old log-probs (on-policy; see actor.py)."""

    def __init__(self, s: Setup, rollout, score, actor):
        self.s, self.rollout, self.score, self.actor = s, rollout, score, actor
        self.count, self.steps, self.phases = 0, [], []

    def __call__(self, record: bool = True) -> None:
        s, times = self.s, {}
        self.count += 1
        seeds = [5000 + 1000 * self.count + i for i in range(BATCH)]
        total, _ = seconds(lambda: self._step(seeds, times), s.device)
        if record:
            self.steps.append((total, int(times.pop("tokens"))))
            self.phases.append(times)

    def _step(self, seeds, times):
        s = self.s
        times["gen"], batch = seconds(lambda: self.rollout.generate_sequences(
            s.prompt_ids, list(range(BATCH)), seeds, response_limit=NEW_TOKENS, physical_batches=[BATCH]), s.device)
        times["teacher"], batch = seconds(lambda: self.score(batch), s.device)
        times["update_actor"], _ = seconds(lambda: self.actor.update_actor(batch, [BATCH]), s.device)
        times["tokens"] = float(batch.response_mask.sum())

    def summary(self) -> dict:
        return {"step_seconds": [round(sec, 4) for sec, _ in self.steps],
                "best_step_seconds": round(best([sec for sec, _ in self.steps]), 4),
                "median_step_seconds": round(median([sec for sec, _ in self.steps]), 4),
                "response_tokens": [tokens for _, tokens in self.steps],
                "median_phase_seconds": {k: round(median([p[k] for p in self.phases]), 4) for k in self.phases[0]}}


def bench_opd_step_trl(s: Setup, student, repeats: int, workdir: Path,
                       between: Callable[[], None]) -> tuple[dict | None, str | None]:
    """TRL's DistillationTrainer, on-policy (it always generates), beta=1 (reverse KL): a warm-up
    step, then `repeats` timed steps, each followed by `between()` (miniverl's step: interleaved)."""
    try:
        import trl
        from datasets import Dataset
        from transformers import TrainerCallback
        from trl import DistillationConfig, DistillationTrainer
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
            if len(self.times) > 1:
                try:
                    between()
                except Exception as error:  # noqa: BLE001 — miniverl's own failure, raised below
                    self.error = error
                    control.should_training_stop = True

    cuda = s.device.type == "cuda"
    args = DistillationConfig(
        output_dir=str(workdir / "trl"), per_device_train_batch_size=BATCH, gradient_accumulation_steps=1,
        max_steps=1 + repeats, max_completion_length=NEW_TOKENS, beta=1.0, temperature=1.0, top_k=0, top_p=1.0,
        learning_rate=1e-5, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.01, max_grad_norm=1.0,
        gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": False},
        bf16=cuda and s.dtype == torch.bfloat16, use_cpu=not cuda, shuffle_dataset=False, seed=0,
        logging_strategy="no", save_strategy="no", report_to="none", disable_tqdm=True, dataloader_num_workers=0)
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": p}] for p in PROMPTS]})
    timer = StepTimer()
    try:
        trainer = DistillationTrainer(model=student, teacher_model=s.teacher, args=args, train_dataset=dataset,
                                      processing_class=s.tokenizer, callbacks=[timer])
        with contextlib.redirect_stdout(io.StringIO()):  # the Trainer prints its closing metrics
            trainer.train()
    except Exception as error:  # noqa: BLE001 — any failure of the peer is reported, not fatal
        if timer.error is not None:
            raise timer.error from None
        return None, f"TRL {trl.__version__} DistillationTrainer failed here: {type(error).__name__}: {error}"
    if timer.error is not None:
        raise timer.error
    if len(timer.times) < 2:
        return None, f"TRL ran {len(timer.times)} steps; need a warm-up and at least one timed step"
    measured = timer.times[1:]
    return {"trl_version": trl.__version__, "step_seconds": [round(t, 4) for t in measured],
            "best_step_seconds": round(best(measured), 4), "median_step_seconds": round(median(measured), 4),
            "warmup_step_seconds": round(timer.times[0], 4)}, None


def bench_update(s: Setup, actor, batch, repeats: int) -> dict:
    student = s.student
    labels = torch.full_like(batch.input_ids, -100)
    labels[:, batch.prompt_length:] = batch.responses.masked_fill(batch.response_mask == 0, -100)

    def ours():
        batch.old_log_probs = None  # as in the trainer: the update's own forward gives them
        actor.update_actor(batch, [BATCH])

    def bare():
        student.train()
        loss = student(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                       position_ids=batch.position_ids, labels=labels).loss
        loss.backward()
        student.zero_grad(set_to_none=True)
        student.eval()

    runs = rounds({"miniverl": ours, "bare_fwd_bwd": bare}, s.device, repeats)
    positions = int(batch.response_mask.numel())
    rates = {name: positions / best([sec for sec, _ in r]) for name, r in runs.items()}
    return {"measurements": {"positions": positions, **{f"{n}_positions_per_s": round(v, 2) for n, v in rates.items()},
                             "runs": {n: [round(sec, 4) for sec, _ in r] for n, r in runs.items()}},
            "ratios": {"update_vs_bare_fwd_bwd": rates["miniverl"] / rates["bare_fwd_bwd"]}}


# ---------------------------------------------------------------------------------------------- report
def verdict(key: str, value: float | None) -> str:
    if value is None:
        return "n/a"
    op, bound = TARGETS[key]
    return "yes" if (value >= bound if op == ">=" else value <= bound) else "no"


def markdown(result: dict) -> str:
    r, m = result["ratios"], result["measurements"]
    ro, sc, up = m["rollout"], m["scoring"], m["update"]
    step = m["opd_step"]
    mib = lambda b: f"{b / 2**20:.1f} MiB" if b is not None else "n/a"  # noqa: E731
    trl = step.get("trl")
    rows = [
        ("rollout tokens/s vs `model.generate(use_cache=True)`", f"{ro['miniverl']['tokens_per_s']:.1f}",
         f"{ro['hf_generate']['tokens_per_s']:.1f}", "rollout_vs_hf_generate"),
        ("rollout tokens/s vs generation without a KV cache", f"{ro['miniverl']['tokens_per_s']:.1f}",
         f"{ro['no_cache']['tokens_per_s']:.1f}", "rollout_vs_no_cache"),
        ("teacher scoring time vs `log_softmax(logits.float()).gather`", f"{sc['miniverl_seconds']:.4f} s",
         f"{sc['naive_seconds']:.4f} s", "scoring_time_vs_naive"),
        ("teacher scoring peak memory vs the same", mib(sc.get("miniverl_peak_bytes")), mib(sc.get("naive_peak_bytes")),
         "scoring_peak_memory_vs_naive"),
        ("one OPD update vs TRL `DistillationTrainer` step (beta=1)", f"{step['miniverl']['best_step_seconds']:.3f} s",
         f"{trl['best_step_seconds']:.3f} s" if trl else "n/a", "opd_step_vs_trl"),
        ("update positions/s vs bare forward+backward", f"{up['miniverl_positions_per_s']:.1f}",
         f"{up['bare_fwd_bwd_positions_per_s']:.1f}", "update_vs_bare_fwd_bwd"),
    ]
    lines = [f"miniverl bench, scale `{result['scale']}` on {result['machine']['device_name']} "
             f"({result['machine']['torch_threads']} torch threads), batch {BATCH}, {NEW_TOKENS} new tokens, "
             f"LoRA r{LORA['r']} on q/v; `{result['command']}`", "",
             "| measurement | miniverl | other | ratio (miniverl ÷ other) | target | met |", "|---|---|---|---|---|---|"]
    for label, ours, other, key in rows:
        op, bound = TARGETS[key]
        value = r[key]
        shown = f"{value:.2f}" if value is not None else "null"
        lines.append(f"| {label} | {ours} | {other} | {shown} | {'≥' if op == '>=' else '≤'} {bound} | "
                     f"{verdict(key, value)} |")
    for key, reason in result["null_reasons"].items():
        lines.append(f"\n`{key}` is null: {reason}")
    return "\n".join(lines) + "\n"


def machine_facts(device: torch.device) -> dict:
    from miniverl.device import hardware_facts
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
    from miniverl.schema.hardware import HardwareConfig
    defaults = HardwareConfig()
    p = argparse.ArgumentParser(prog="python -m miniverl.bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--scale", choices=sorted(SCALES), default="bench")
    p.add_argument("--out", default=None, help="output folder (default outputs/bench/<scale>)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--repeats", type=int, default=None, help="timed rounds per measurement (default per scale)")
    p.add_argument("--no-trl", action="store_true", help="skip TRL (opd_step_vs_trl is then null)")
    p.add_argument("--logprob-chunk", type=int, default=defaults.logprob_chunk, help="hardware.logprob_chunk")
    p.add_argument("--static-cache", action=argparse.BooleanOptionalAction, default=defaults.rollout_static_cache,
                   help="hardware.rollout_static_cache")
    p.add_argument("--compile-decode", action=argparse.BooleanOptionalAction, default=defaults.rollout_compile,
                   help="hardware.rollout_compile")
    p.add_argument("--cpu-gemv", action=argparse.BooleanOptionalAction, default=defaults.rollout_cpu_gemv,
                   help="hardware.rollout_cpu_gemv")
    args = p.parse_args(argv)
    args.argv = list(argv)
    return args


def run(args: argparse.Namespace) -> dict:
    from miniverl.schema.hardware import HardwareConfig

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no GPU")
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    hw = HardwareConfig(device=device.type, logprob_chunk=args.logprob_chunk, rollout_static_cache=args.static_cache,
                        rollout_compile=args.compile_decode, rollout_cpu_gemv=args.cpu_gemv)
    repeats = args.repeats or SCALES[args.scale]["repeats"]
    out = Path(args.out or Path("outputs") / "bench" / args.scale)
    out.mkdir(parents=True, exist_ok=True)
    command = " ".join(["python -m miniverl.bench", *args.argv])
    started = time.perf_counter()
    memory = PeakMemory(device)
    with quiet():
        s = build_setup(args.scale, device, dtype)
        # TRL trains its own copy: the same weights and LoRA, taken before any update.
        trl_student = None if args.no_trl else copy.deepcopy(s.student)
        rollout, score, actor = miniverl_workers(s, hw)
        log.info("rollout")
        rollout_result, batch = bench_rollout(s, rollout, repeats)
        log.info("scoring")
        scoring = bench_scoring_time(s, batch, hw, repeats)
        log.info("OPD step")
        ours = OursOPDStep(s, rollout, score, actor)
        ours(record=False)  # warm-up
        null_reasons = {}
        if args.no_trl:
            trl_result, reason = None, "skipped (--no-trl)"
        else:
            with tempfile.TemporaryDirectory(dir=out) as workdir:
                trl_result, reason = bench_opd_step_trl(s, trl_student, repeats, Path(workdir), between=ours)
        if reason:
            null_reasons["opd_step_vs_trl"] = reason
        del trl_student
        while len(ours.steps) < repeats:  # without TRL (or if it stopped early)
            ours()
        ours_step = ours.summary()
        log.info("update")
        update = bench_update(s, actor, score(batch), repeats)
        log.info("peak memory")
        peaks = peak_memory(memory, scoring["calls"])
    if memory.reason:
        null_reasons["scoring_peak_memory_vs_naive"] = memory.reason
    ratios = {**rollout_result["ratios"], **scoring["ratios"], **update["ratios"],
              "scoring_peak_memory_vs_naive": (peaks["miniverl"] / peaks["naive"]) if peaks["naive"] else None,
              "opd_step_vs_trl": (ours_step["best_step_seconds"] / trl_result["best_step_seconds"])
              if trl_result else None}
    if trl_result:  # the medians' ratio too: the best-of ratio is the table's
        ours_step["median_ratio_vs_trl"] = round(ours_step["median_step_seconds"] / trl_result["median_step_seconds"], 4)
    shape = {k: v for k, v in SCALES[args.scale].items() if k != "repeats"}
    shape["vocab_size"] = s.student.get_base_model().config.vocab_size
    result = {
        "schema": SCHEMA,
        "command": command,
        "scale": args.scale,
        "ratios": {k: (round(ratios[k], 4) if ratios[k] is not None else None) for k in RATIO_KEYS},
        "targets": {k: f"{op} {bound}" for k, (op, bound) in TARGETS.items()},
        "null_reasons": null_reasons,
        "settings": {"batch": BATCH, "new_tokens": NEW_TOKENS, "lora": {**LORA, "target_modules": list(LORA["target_modules"])},
                     "student_gradient_checkpointing": True, "dtype": str(dtype).replace("torch.", ""),
                     "repeats": repeats, "shape": shape, "teacher": "the student's shape, another seed",
                     "hardware": {"logprob_chunk": hw.logprob_chunk, "rollout_static_cache": hw.rollout_static_cache,
                                  "rollout_compile": hw.rollout_compile, "rollout_cpu_gemv": hw.rollout_cpu_gemv},
                     "prompt_tokens": [len(p) for p in s.prompt_ids]},
        "measurements": {
            "rollout": rollout_result["measurements"],
            "scoring": {**scoring["measurements"], "miniverl_peak_bytes": peaks["miniverl"],
                        "naive_peak_bytes": peaks["naive"]},
            "opd_step": {"miniverl": ours_step, "trl": trl_result},
            "update": update["measurements"],
        },
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
