"""Pre-flight checks (the library of `python -m miniverl.doctor`, miniverl/doctor.py).

Before hours of GPU time, check that the teacher and the student can be distilled at all. Each
check is one line, PASS / WARN / FAIL with the reason.

    data          rows, prompt lengths against recipe.prompt_limit, enough prompts for the plan
    tokenizer     same vocabulary, output rows covering it (padding past it may differ), same
                  special tokens, same chat template (`topk`: a top-k loss's k at most the vocabulary);
                  with teacher.tokenizer_alignment=text and another tokenizer, the share of the
                  data's text that aligns into common spans
    memory        an estimate of the peak memory against the hardware option's limit
    positions     every model from a folder: its prompt limit + the longest response (recipe.response_limit,
                  or a longer eval.response_limit) within its max_position_embeddings
    routing       several teachers: every row's teacher_key value has a teacher (or a default)
    context       a teacher with a privileged context: its prompt renders for every row (a missing
                  field names the row) and fits its limit
    self-test     the teacher path scoring the student's own samples with the student's own
                  weights gives a k1 of ~0 (rollout and scoring agree position by position,
                  within the tolerance of the compute precision: miniverl/models/precision.py;
                  a WARN where only the largest is over it: bf16 rounding's tail)
    nf4-gradients LoRA gradients through the NF4 base equal those through a dense twin that
                  multiplies the dequantized weights in the same compute dtype

The training command (`miniverl.main`) runs the cheap ones (data, tokenizer, attention, positions, memory, topk, reward,
routing, context) first and stops on a FAIL. The two that load the models, self-test and
nf4-gradients, are in model_checks.py; the self-test scores without any teacher context.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import psutil
import torch

from miniverl.config import MiniverlConfig
from miniverl.config.model import StudentConfig
from miniverl.config.teacher import TeacherConfig
from miniverl.models import loading as models
from miniverl.models import nf4_cache, tokenizers
from miniverl.models.attention import attention_problem
from miniverl.trainer import plan
from miniverl.trainer.memory_estimate import architecture, estimate_peak_bytes
from miniverl.trainer.plan import read_rows, route_column, teacher_contexts, teacher_routes, uses_context
from miniverl.utils.dataset import count_rows, missing_data_file, prompt_ids, read_conversations, tokenize_prompts
from miniverl.utils.errors import MiniverlError
from miniverl.utils.measure import GIB
from miniverl.utils.text_alignment import align_response


@dataclass
class Check:
    status: str  # PASS | WARN | FAIL
    name: str
    reason: str

    def __str__(self) -> str:
        return f"{self.status:<4} {self.name}: {self.reason}"


def guarded(name: str, fn, *args) -> Check:
    """A check whose own failure (unreadable data, missing weights) is that check's FAIL."""
    try:
        return fn(*args)
    except MiniverlError as error:
        return Check("FAIL", name, str(error))
    except Exception as error:  # a model the check did not foresee: its FAIL, and the other checks still run
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        said = f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}"
        return Check("FAIL", name, f"the check itself failed ({said}); HYDRA_FULL_ERROR=1 shows where")


# ------------------------------------------------------------------ cheap checks
def check_data(cfg: MiniverlConfig, tokenizer) -> Check:
    if missing := missing_data_file(cfg.data, ("val_files",)):  # verl reads its val_files at start-up, test_freq or not
        return Check("FAIL", "data", missing)
    unread = cfg.data.val_files and cfg.eval.every == -1
    conversations = read_conversations(cfg.data)
    lengths = [
        len(prompt_ids(m, cfg.data, tokenizer, conversations.row_name(row)))
        for row, m in enumerate(conversations.messages)
    ]
    limit = cfg.recipe.prompt_limit
    over = [row for row, n in enumerate(lengths) if n > limit]
    usable = len(lengths) - len(over)
    needed = cfg.recipe.logical_batch * cfg.recipe.optimizer_updates
    facts = f"{len(lengths)} rows, prompt tokens {min(lengths)}..{max(lengths)} (limit {limit})"
    if over and not cfg.data.filter_overlong_prompts:
        return Check(
            "FAIL",
            "data",
            f"{facts}: {len(over)} over the limit (first: {conversations.row_name(over[0])}); raise "
            "recipe.prompt_limit or set data.filter_overlong_prompts=true",
        )
    if usable < cfg.recipe.logical_batch:
        return Check(
            "FAIL",
            "data",
            f"{facts}: {usable} usable prompts, fewer than recipe.logical_batch="
            f"{cfg.recipe.logical_batch}; the plan needs {needed} prompts",
        )
    if usable < needed:
        status = "WARN" if cfg.data.repeat_prompts else "FAIL"
        fix = "" if cfg.data.repeat_prompts else "; add prompts or set data.repeat_prompts=true"
        batches = plan.batches_per_pass(usable, cfg.recipe.logical_batch)
        passes, left = -(-cfg.recipe.optimizer_updates // batches), usable - batches * cfg.recipe.logical_batch
        left_out = f", {left} prompts a pass left out (its last partial batch, as verl drops it)" if left else ""
        line = f"{facts}: the plan consumes {needed} prompts from {usable} usable ones ({passes} passes{left_out})"
        return Check(status, "data", line + fix)
    dropped = f", {len(over)} dropped as overlong" if over else ""
    line = f"{facts}{dropped}; the plan consumes {needed} of {usable} usable prompts"
    if unread:
        line += "; data.val_files is not read with eval.every=-1 (eval.every=N measures held-out progress)"
    if conversations.plain_strings:  # a column picked by mistake (data.prompt_key) trains on whatever it holds
        column = cfg.data.prompt_key
        line += (
            f"; column {column!r} holds plain strings in {conversations.plain_strings} rows, each taken as one user "
            "message (verl reads lists of {role, content} messages): check data.prompt_key"
        )
    return Check("WARN" if unread or conversations.plain_strings else "PASS", "data", line)


def check_reward(cfg: MiniverlConfig) -> Check:
    """With task rewards: every row can be scored (the trainer checks the same before loading)."""
    from miniverl.utils.reward_score import load_custom_reward_function
    from miniverl.workers.reward import check_rule_rows

    tasks = read_conversations(cfg.data).tasks
    custom = cfg.reward.custom_reward_function
    if custom.path:
        load_custom_reward_function(custom.path, custom.name)
        return Check("PASS", "reward", f"{len(tasks)} rows scored by {custom.name} of {custom.path}")
    check_rule_rows(range(len(tasks)), dict(enumerate(tasks)))
    sources = sorted({t.data_source for t in tasks})
    return Check("PASS", "reward", f"{len(tasks)} rows, each with its data_source's rule ({', '.join(sources)})")


def check_tokenizers(cfg: MiniverlConfig, student_tok) -> Check:
    """Every separate teacher scores the student's token ids (ref / shared_base share them)."""
    facts, scored, padded, status = [], [], False, "PASS"
    for name, block in cfg.teacher_blocks.items():
        where = cfg.teacher_where(name)
        if block.mode != "standard":
            facts.append(f"{where}.mode={block.mode} shares the student's tokenizer and base")
            continue
        teacher_tok = models.load_tokenizer(where, block, models.source_of(block, None))
        if block.text_aligned and tokenizers.tokenizers_differ(student_tok, teacher_tok):
            alignment = check_alignment(cfg, student_tok, teacher_tok)
            if alignment.status == "FAIL":
                return alignment
            facts.append(alignment.reason)  # and the student's own end of turn below, as with one tokenizer
            status = alignment.status
            continue
        rows = (architecture("model", cfg.model)["vocab"], architecture(where, block)["vocab"])
        problem = tokenizers.tokenizer_problem(student_tok, teacher_tok, *rows, where)
        if problem:
            return Check("FAIL", "tokenizer", f"{where}: {problem}" if cfg.teachers else problem)
        padded = padded or not rows[0] == rows[1] == len(student_tok)
        scored.append(f"{where if cfg.teachers else 'teacher'} {rows[1]}")
    if scored:
        student_rows = architecture("model", cfg.model)["vocab"]
        padding = "; output rows past the tokenizer are padding, never sampled or scored" if padded else ""
        facts.append(
            f"vocabulary {len(student_tok.get_vocab())} (embedding rows: student {student_rows}, {', '.join(scored)}), "
            f"eos, and chat template output identical{padding}"
        )
    if cfg.model.model_id != "toy":  # the student's own, whatever its teacher (a toy's files come at the start)
        stops = tokenizers.configured_stop_ids(student_tok, models.source_of(cfg.model, None))
        facts.append(f"responses end at ids {stops} (the tokenizer's EOS and the model's generation config)")
        if problem := tokenizers.stop_ids_problem(student_tok, stops):
            return Check("WARN", "tokenizer", "; ".join([*facts, problem]))
    return Check(status, "tokenizer", "; ".join(facts))


def check_alignment(cfg: MiniverlConfig, student_tok, teacher_tok) -> Check:
    """A teacher of another tokenizer (tokenizer_alignment=text): the share of the student's tokens
    of the training rows' text (their prompts and answers) that align into spans with the teacher's
    tokens; a token that cannot is never trained on (distillation/unaligned_fraction)."""
    conversations = read_conversations(cfg.data)
    texts = [m[-1]["content"] for m in conversations.messages] + [a for a in conversations.answers if a]
    tokens, aligned, floor = 0, 0, cfg.teacher.unwritable_byte_log_prob is not None  # a floor scores holes
    for text in texts:
        ids = student_tok(text, add_special_tokens=False)["input_ids"]
        kept = align_response(student_tok, ids, teacher_tok, stopped=False, teacher_stop_id=None, score_holes=floor)
        tokens, aligned = tokens + len(ids), aligned + len(ids) - kept.unaligned_student_tokens
    rate = aligned / tokens if tokens else 1.0
    line = (
        f"teacher.tokenizer_alignment=text: the student's {len(student_tok)}-token vocabulary and the teacher's "
        f"{len(teacher_tok)} align {rate:.1%} of the student's {tokens} tokens of the training rows' text "
        f"({len(texts)} prompts and answers) into common spans"
    )
    if rate < 0.5:
        return Check("FAIL", "tokenizer", line + "; most tokens would never be trained on: pick a closer teacher")
    return Check("PASS" if rate >= 0.95 else "WARN", "tokenizer", line)


def own_prompts(cfg: MiniverlConfig) -> bool:
    """A teacher of another tokenizer renders its own prompt for every row (its chat template)."""
    return any(t.text_aligned for t in cfg.teacher_blocks.values())


def check_topk(cfg: MiniverlConfig, tokenizer) -> Check:
    k, n = cfg.estimator.topk, len(tokenizer)  # a loss over a top-k (the teacher's or the student's) needs k tokens
    fix = f"estimator.topk={k} is larger than the vocabulary ({n} tokens); set estimator.topk to at most {n}"
    return Check("FAIL", "topk", fix) if k > n else Check("PASS", "topk", f"estimator.topk={k} of {n} tokens")


def check_context(cfg: MiniverlConfig, tokenizer) -> Check:
    """A teacher with a privileged context: its prompt renders for every row and fits its limit."""
    facts = []
    for key in ("train_files", "val_files"):
        if getattr(cfg.data, key):
            rows = read_rows(cfg, key)
            kept = tokenize_prompts(rows, cfg.data, tokenizer, cfg.recipe.prompt_limit).rows
            for name, prompts in teacher_contexts(cfg, rows, kept, tokenizer, f"data.{key}").items():
                lengths = [len(ids) for ids in prompts.values()]
                facts.append(f"{cfg.teacher_where(name)} on data.{key}: {min(lengths)}..{max(lengths)} tokens")
    if not facts:  # tokenizer_alignment=text with the student's own tokenizer: the student's prompts
        return Check("PASS", "context", "the teacher reads the student's prompts (its tokenizer is the student's)")
    return Check("PASS", "context", "the teacher's own prompts render for every row: " + "; ".join(facts))


def check_routing(cfg: MiniverlConfig) -> Check:
    """Several teachers: every row of the training and held-out files has a teacher."""
    counts: dict[str, int] = {}
    for key in ("train_files", "val_files"):
        if getattr(cfg.data, key):
            values = dict(enumerate(read_conversations(cfg.data, key, route_column(cfg)).routes))
            for name in teacher_routes(cfg, values, f"data.{key}").values():
                counts[name] = counts.get(name, 0) + 1
    shares = ", ".join(f"{name} {counts.get(name, 0)}" for name in cfg.teachers)
    return Check("PASS", "routing", f"rows by {cfg.teacher_key}: {shares}")


def check_positions(cfg: MiniverlConfig) -> Check:
    """Every model from a folder reads its prompt limit and the longest response (cfg.longest_response): within
    the positions its config says it was trained for (max_position_embeddings), as verl's vLLM rollout
    requires of max_model_len (without VLLM_ALLOW_LONG_MAX_MODEL_LEN). transformers would run past them
    silently, on positions the model never saw (a text-aligned teacher's response is the student's text in
    its own tokens: counted as recipe.response_limit here)."""
    facts, problems = [], []
    response_key, response = cfg.longest_response()
    folders = dict(loaded_model_blocks(cfg))
    for where, block, limit_key, limit in cfg.prompt_limits():
        if where not in folders:  # a toy (checked by the config) or a teacher running on the student's model
            continue
        positions = architecture(where, block)["positions"]
        if positions is not None and limit + response > positions:
            problems.append(
                f"{where}: {limit_key} + {response_key} = {limit + response} tokens is beyond its "
                f"max_position_embeddings ({positions}, the positions it was trained for; verl's vLLM rollout "
                f"refuses such a max_model_len too): lower {limit_key} or {response_key}"
            )
        limited = f"of {positions} positions" if positions is not None else "positions (its config names no limit)"
        facts.append(f"{where} {limit + response} {limited}")
    if problems:
        return Check("FAIL", "positions", "; ".join(problems))
    return Check("PASS", "positions", "; ".join(facts))


def check_memory(cfg: MiniverlConfig, device: torch.device) -> Check:
    """The estimate against the device's memory. On the CPU the report's peak is the process's
    resident memory, so what the process holds already (Python, torch, transformers: about 0.4 GiB)
    is added; on CUDA the report's peak is torch's reserved memory, which holds only the run's tensors."""
    heldout_rows = count_rows(cfg.data.val_files or []) if cfg.eval.every != -1 else None  # the probe's rows
    estimate = estimate_peak_bytes(cfg, device.type, heldout_rows) / GIB
    runtime = psutil.Process().memory_info().rss / GIB if device.type == "cpu" else 0.0
    if cfg.hardware.peak_reserved_limit_gib is not None and device.type == "cuda":  # a limit of GPU memory
        limit, what = (
            cfg.hardware.peak_reserved_limit_gib,
            f"hardware.peak_reserved_limit_gib={cfg.hardware.peak_reserved_limit_gib}",
        )
    elif device.type == "cuda":  # what is free: another process (a desktop's display, a notebook) holds the rest
        free, total = torch.cuda.mem_get_info(device)
        limit, what = free / GIB, f"the free memory of the GPU's {total / GIB:.3g} GiB"
    else:
        limit, what = psutil.virtual_memory().total / GIB, "this machine's memory"
    parts = f" ({estimate:.2f} GiB of models, cache, activations and optimizer + {runtime:.2f} GiB the process holds)"
    line = f"estimated peak {estimate + runtime:.2f} GiB{parts if runtime else ''} against {what} ({limit:.3g} GiB)"
    estimate += runtime
    if estimate > limit:
        return Check(
            "FAIL",
            "memory",
            line + "; lower recipe.response_limit, hardware.rollout_physical_batch, hardware.update_chunk or "
            "hardware.logprob_chunk",
        )
    if experts := architecture("model", cfg.model).get("expert_weights", 0):  # Qwen3-MoE, Mixtral, ...
        return Check(
            "WARN",
            "memory",
            f"{line}; the student's routed experts ({experts / 1e6:.3g}M weights, 3-D parameters, not linear layers) "
            "load unquantized: NF4 takes linear layers only (peft may adapt them: the adapter's target_parameters)",
        )
    return Check("WARN" if estimate > 0.8 * limit else "PASS", "memory", line)


def loaded_model_blocks(cfg: MiniverlConfig) -> list[tuple[str, StudentConfig | TeacherConfig]]:
    """(config path, block) of every model the run loads from a folder or the hub (not the toys)."""
    blocks = [("model", cfg.model)]
    blocks += [(cfg.teacher_where(name), b) for name, b in cfg.teacher_blocks.items() if b.mode == "standard"]
    return [(where, block) for where, block in blocks if block.model_id != "toy"]


def check_attention(cfg: MiniverlConfig, device: torch.device) -> Check:
    """Every model whose attention cannot run here (a family without SDPA in transformers, flash
    attention without CUDA or its package, a name transformers does not know), in one line before
    any loads (loading would refuse them one at a time, some with a traceback)."""
    lacking, facts, problems, unchecked = {}, [], [], False
    for where, block in loaded_model_blocks(cfg):
        family = models.model_class(block, models.source_of(block, None))
        name, problem = block.attn_implementation, attention_problem(block, device, family)
        if name == "sdpa" and problem is not None:
            lacking[where] = family.__name__
        elif problem is not None:
            problems.append(
                f"{where}.attn_implementation={name}: {problem}; set sdpa (where the family has it) or eager"
            )
        else:  # a config.json not readable here: loading says what is wrong
            facts.append(f"{where} {name} ({family.__name__ if family else 'not checked: no config.json read'})")
            unchecked |= family is None
    if lacking:
        fix = " ".join(f"{where}.attn_implementation=eager" for where in lacking)
        problems.append(f"transformers has no SDPA attention for {', '.join(sorted(set(lacking.values())))}; set {fix}")
    if problems:
        return Check("FAIL", "attention", "; ".join(problems))
    return Check("WARN" if unchecked else "PASS", "attention", "; ".join(facts))


def check_precision(cfg: MiniverlConfig, device: torch.device) -> Check:
    """On CUDA, a bf16 compute dtype on a GPU without bf16 arithmetic (before Ampere: a T4, a V100),
    where torch only emulates it and bitsandbytes' NF4 kernels have fp16 alone: refused, with the keys."""
    blocks = [("model", cfg.model)] + [(cfg.teacher_where(n), b) for n, b in cfg.teacher_blocks.items()]
    dtypes = {where: planned_dtype(b) for where, b in blocks if where == "model" or b.mode == "standard"}
    named = ", ".join(f"{where} {str(dtype).removeprefix('torch.')}" for where, dtype in dtypes.items())
    line = f"{torch.cuda.get_device_name(device)}: compute in {named}"
    bf16 = [where for where, dtype in dtypes.items() if dtype == torch.bfloat16]
    if bf16 and not torch.cuda.is_bf16_supported(including_emulation=False):
        major, minor = torch.cuda.get_device_capability(device)
        fix = "set " + " ".join(f"{where}.dtype=float16" for where in bf16)
        return Check("FAIL", "precision", f"{line}; compute capability {major}.{minor} has no bf16 arithmetic: {fix}")
    return Check("PASS", "precision", line)


def saved_quantizations(cfg: MiniverlConfig) -> dict[str, tuple[StudentConfig | TeacherConfig, dict]]:
    """{config path: (block, its quantization_config)} of the models saved quantized already, on this machine."""
    found = {}
    for where, block in loaded_model_blocks(cfg):
        source = models.source_of(block, None)
        folder = nf4_cache.source_folder(source.path, source.revision)
        if folder is not None and (saved := nf4_cache.saved_quantization(folder)) is not None:
            found[where] = (block, saved)
    return found


def check_quantization(cfg: MiniverlConfig) -> Check:
    """A checkpoint saved quantized already (a `-bnb-4bit` repository) loads as it was saved, whatever its
    block's `quantization` says (models/loading.py gives transformers no settings of its own for it): each
    such model and what differs from the block's NF4 (no double quantization, the block's compute dtype)."""
    said = []
    for where, (block, saved) in saved_quantizations(cfg).items():
        differs = [f"quantized where {where}.quantization={block.quantization}"] if block.quantization != "nf4" else []
        if saved.get("quant_method") != "bitsandbytes" or not saved.get("load_in_4bit"):
            differs.append(f"{saved.get('quant_method')}{' 8-bit' if saved.get('load_in_8bit') else ''}, not NF4")
        else:
            dtype = str(saved.get("bnb_4bit_compute_dtype")).removeprefix("torch.")
            theirs = (saved.get("bnb_4bit_quant_type"), bool(saved.get("bnb_4bit_use_double_quant")), dtype)
            ours = ("nf4", False, str(planned_dtype(block)).removeprefix("torch."))
            names = ("quant type", "double quantization", "compute dtype")
            differs += [f"{n} {t} (not {o})" for n, t, o in zip(names, theirs, ours) if t != o]
        said.append((f"{where}.model_id={block.model_id} is saved quantized and loads so: ", differs))
    if not any(differs for _, differs in said):
        return Check("PASS", "quantization", "; ".join(f"{line}NF4, as miniverl quantizes" for line, _ in said))
    return Check("WARN", "quantization", "; ".join(line + ", ".join(differs) for line, differs in said if differs))


def planned_dtype(block: StudentConfig | TeacherConfig) -> torch.dtype:
    """The dtype a model will compute in (a toy's: the one its weights are written in, with `dtype: auto`)."""
    if block.model_id == "toy":
        return models.TORCH_DTYPES[block.toy.dtype if block.dtype == "auto" else block.dtype]
    return models.compute_dtype(block, models.source_of(block, None))


def cheap_checks(cfg: MiniverlConfig, device: torch.device) -> list[Check]:
    tokenizer = models.load_tokenizer("model", cfg.model, models.source_of(cfg.model, None))
    return [
        guarded("data", check_data, cfg, tokenizer),
        guarded("tokenizer", check_tokenizers, cfg, tokenizer),
        *([guarded("attention", check_attention, cfg, device)] if loaded_model_blocks(cfg) else []),
        *([guarded("positions", check_positions, cfg)] if loaded_model_blocks(cfg) else []),
        *([guarded("precision", check_precision, cfg, device)] if device.type == "cuda" else []),
        *([guarded("quantization", check_quantization, cfg)] if saved_quantizations(cfg) else []),
        guarded("memory", check_memory, cfg, device),
        *([guarded("topk", check_topk, cfg, tokenizer)] if cfg.estimator.topk_loss else []),
        *([guarded("reward", check_reward, cfg)] if cfg.estimator.use_task_rewards else []),
        *([guarded("routing", check_routing, cfg)] if cfg.routed else []),
        *([guarded("context", check_context, cfg, tokenizer)] if uses_context(cfg) or own_prompts(cfg) else []),
    ]
