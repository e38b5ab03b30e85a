"""The pieces on one path: miniverl's workers, the rollout vs `generate`, the teacher's scoring vs
the naive log-softmax, the update vs a bare forward+backward, and `measure_path`, which runs them
all (with the OPD step vs TRL of opd_step.py)."""

from __future__ import annotations

import contextlib
import copy
import gc
import logging
from contextlib import contextmanager
from pathlib import Path

import torch

from miniverl.bench.measuring import best, median, rounds
from miniverl.bench.opd_step import OursOPDStep, bench_opd_step_trl
from miniverl.bench.setups import BATCH, NEW_TOKENS, PREFIX, TRL_KINDS, Setup
from miniverl.utils.measure import four_bit_storage_bytes

log = logging.getLogger("miniverl.bench")


def response_tokens(completions: torch.Tensor, eos_id: int) -> int:
    """Tokens of (b, n) generated ids up to and including each row's first EOS."""
    is_eos = completions.eq(eos_id)
    first = torch.where(
        is_eos.any(1), is_eos.int().argmax(1) + 1, torch.full_like(is_eos[:, 0], completions.shape[1], dtype=torch.long)
    )
    return int(first.sum())


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
    from miniverl.models import cpu_gemm

    return cpu_gemm.enabled_for(hw, s.device)


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
        cpu_prepack=hw.rollout_cpu_prepack,
        cpu_fp16_lm_head=hw.rollout_cpu_fp16_lm_head,
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
    from miniverl.protocol import left_pad

    ids, mask = left_pad(s.prompt_ids, s.pad_id, s.device)
    base = s.student.get_base_model()
    peer = s.peer_base()  # generate's model: the same weights, bitsandbytes as shipped
    round_of = {}  # method -> calls so far: the same seeds for the same round of every method
    batches = {"miniverl": [], "miniverl_per_call_dequantize": []}
    decodes = []  # what each rollout's decode fast paths held and did (LeanDecode)

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
                decodes.append(rollout.last_decode)
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
            out = peer.generate(input_ids=ids, attention_mask=mask, **sample_kwargs("hf_generate"))
        return response_tokens(out[:, ids.shape[1] :], s.eos_id)

    def one_row_generate():  # each prompt alone, batch 1, KV cache: a simple trainer's rollout
        s.student.eval()
        kwargs, tokens = sample_kwargs("one_row_generate"), 0
        with torch.no_grad():
            for prompt in s.prompt_ids:
                row = torch.tensor([prompt], dtype=torch.long, device=s.device)
                out = peer.generate(input_ids=row, attention_mask=torch.ones_like(row), **kwargs)
                tokens += response_tokens(out[:, row.shape[1] :], s.eos_id)
        return tokens

    methods = {"miniverl": ours("miniverl"), "hf_generate": hf_generate}
    four_bit = four_bit_storage_bytes(base)
    null_reasons = {}
    per_call_key = PREFIX[s.path] + "rollout_vs_per_call_dequantize"
    if s.path in ("recipe", "real"):
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
    result["miniverl"]["dequantized_bytes"] = max((d.dequantized_bytes for d in decodes), default=0)
    # The decode's CPU fast paths as they ran (the last round): layers reordered for oneDNN, the
    # bytes of the lm_head's float16 copy (0: the float32 head).
    result["miniverl"]["reordered_layers"] = decodes[-1].reordered_layers if decodes else 0
    result["miniverl"]["fp16_head_bytes"] = decodes[-1].fp16_head_bytes if decodes else 0
    result["miniverl"]["four_bit_storage_bytes"] = four_bit
    if s.path == "real":
        # The fastest timed round and its own batch (the warm-up round's batch comes first).
        timed = fast["miniverl"]
        fastest = min(range(len(timed)), key=lambda i: timed[i][0])
        batch_of_round = batches["miniverl"][len(batches["miniverl"]) - len(timed) + fastest]
        steps = int(batch_of_round.response_mask.sum(1).max())
        if s.device.type == "cpu":
            held_bytes = result["miniverl"]["dequantized_bytes"], result["miniverl"]["fp16_head_bytes"]
            result["miniverl"]["decode"] = decode_traffic(base, *held_bytes, steps, timed[fastest][0])
        else:  # the 4-bit weights stay packed and the bandwidth measure is the CPU's
            result["miniverl"]["decode"] = {"null_reason": "measured on the CPU only"}
    if "miniverl_per_call_dequantize" in speed:
        ratios[per_call_key] = speed["miniverl"] / speed["miniverl_per_call_dequantize"]
        pairs = list(zip(batches["miniverl"], batches["miniverl_per_call_dequantize"]))
        result["miniverl"]["same_tokens_and_log_probs_as_per_call_dequantize"] = all(
            torch.equal(a.responses, b.responses) and torch.equal(a.rollout_log_probs, b.rollout_log_probs)
            for a, b in pairs
        )
    return {"measurements": result, "ratios": ratios, "null_reasons": null_reasons}, batches["miniverl"][-1]


def decode_weight_bytes(model, dequantized_bytes: int, fp16_head_bytes: int = 0) -> int:
    """Bytes of weights one decode step reads: the dense copies of the 4-bit weights, the lm_head
    (its float16 copy where the decode read one), and every other parameter once (a tied lm_head
    is the embedding; an untied embedding is read one row a token, so not counted)."""
    embedding, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    tied = embedding is head
    seen, total = set(), dequantized_bytes + fp16_head_bytes
    for param in model.parameters():
        if id(param) in seen or param.dtype == torch.uint8 or (param is embedding and not tied):
            continue  # uint8: packed 4-bit storage, counted as its dense copy
        seen.add(id(param))
        if not (param is head and fp16_head_bytes):  # counted as its copy
            total += param.numel() * param.element_size()
    return total


def decode_traffic(model, dequantized_bytes: int, fp16_head_bytes: int, steps: int, seconds: float) -> dict:
    """The decode loop against the physical limit: weight bytes read per step and per second, and
    the fraction of this machine's memory bandwidth that is (a lower bound: the timed rollout
    includes the prompt's prefill)."""
    from miniverl.bench.measuring import memory_bandwidth_bytes_per_s

    per_step = decode_weight_bytes(model, dequantized_bytes, fp16_head_bytes)
    bandwidth = memory_bandwidth_bytes_per_s()
    achieved = per_step * steps / seconds
    return {
        "weight_bytes_per_step": per_step,
        "weight_bytes_per_token": per_step // BATCH,  # one step decodes one token of each row
        "steps": steps,
        "weight_bytes_per_s": round(achieved),
        "memory_bandwidth_bytes_per_s": round(bandwidth),
        "fraction_of_bandwidth": round(achieved / bandwidth, 4),
    }


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

    methods = {"miniverl": ours, "naive": naive}
    if s.path == "real":  # the peer: one plain forward of the teacher as shipped
        shipped = s.peer_teacher or s.teacher

        def hf_forward():
            with torch.no_grad():
                return naive_teacher_log_probs(shipped, batch)

        methods["hf_forward"] = hf_forward
    # No warm-up: the teacher has run in the warm-up OPD step; the naive path's first call only
    # adds its page faults, and the best of the rounds counts. The peer's copy warms up once.
    if "hf_forward" in methods:
        methods["hf_forward"]()
    runs = rounds(methods, s.device, repeats, warmup=0)
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
        "ratios": {
            PREFIX[s.path] + "scoring_time_vs_naive": times["miniverl"] / times["naive"],
            # a speed: the peer's time over ours
            **(
                {"real_scoring_vs_hf_forward": times["hf_forward"] / times["miniverl"]} if "hf_forward" in times else {}
            ),
        },
        "calls": {"miniverl": ours, "naive": naive},
    }


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
    # TRL trains its own copies: the same weights and LoRA, taken before any update (bitsandbytes
    # as shipped where the setup has a peer copy).
    trl_students = {} if no_trl else {kind: copy.deepcopy(s.peer_student or s.student) for kind in TRL_KINDS[s.path]}
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
