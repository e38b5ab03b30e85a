"""`python -m miniverl.bench --losses`: the memory of the distillation losses, measured on one update of
a small random Qwen3 student and teacher (no download; docs/objectives.md, docs/losses.md).

    python -m miniverl.bench --losses [--vocab 8192] [--out DIR]

Two tables:

1. token selection (`estimator.token_selection`): for each loss family, the peak bytes of the loss's
   forward + backward (the selection made beforehand), of the selection pass alone and of the whole
   `accumulate_gradients`, with every response token and with keep 0.5 and 0.25 (by entropy). One
   update of B x R = 128 positions (102 response tokens) in one chunk of positions, float32, the
   vocabulary `--vocab`;
2. verl 0.9's chunked top-k (`estimator.use_chunked_topk`): the peak of `forward_kl_topk`'s forward +
   backward on (B, T, V) logits, chunked and not, beside the sizes of one (B, T, V) float32 tensor
   and of the logits' gradient.

On the CPU: a peak is the most bytes live at once while the call runs, above what was live before,
from every allocation and free the allocator reports to torch's profiler, in time order. Sizes here
are small enough to take seconds; what scales with the positions and the vocabulary is the point,
not the absolute bytes.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from functools import partial
from pathlib import Path

import torch

from miniverl.config.actor import ActorConfig
from miniverl.config.estimator import EstimatorConfig, TokenSelectionConfig
from miniverl.protocol import assemble
from miniverl.workers.logprobs import response_hidden_states
from miniverl.workers.losses import batch_normalisers
from miniverl.workers.topk_loss import forward_kl_topk

MIB = 2**20
TOPK = 8  # the teacher's top-k columns of the toy batch
# The loss families of the selection table: name -> estimator settings.
FAMILIES = {
    "k3 (direct)": dict(loss_mode="k3"),
    "k1 (policy gradient)": dict(loss_mode="k1", use_policy_gradient=True),
    "forward_kl_topk": dict(loss_mode="forward_kl_topk", topk=TOPK),
    "forward_kl_topk_tail": dict(loss_mode="forward_kl_topk_tail", topk=TOPK),
    "reverse_kl_topk": dict(loss_mode="reverse_kl_topk", topk=TOPK),
    "reverse_kl_full": dict(loss_mode="reverse_kl_full"),
}
KEEPS = (1.0, 0.5, 0.25)
SELECTION_LENGTHS = (32, 24, 30, 16)  # response lengths of the update's 4 rows: 102 tokens, R = 32


@contextlib.contextmanager
def kineto_lines_silenced():
    """The process's stderr (file descriptor 2) sent to /dev/null: torch's profiler (kineto, C++) writes a
    `USDT: ... profiler_start` / `profiler_stop` line there at every start and stop, whatever its log level
    (about a hundred lines a run). Only the start and the stop are silenced, not the measured call."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def peak_bytes(fn) -> int:
    """The most bytes allocated on the CPU at once while fn() runs, above what was allocated before."""
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    with kineto_lines_silenced():
        prof.start()
    try:
        fn()
    finally:
        with kineto_lines_silenced():
            prof.stop()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    if not events:
        raise RuntimeError("torch's profiler reported no allocation: cannot measure the peak")
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak


def small_qwen3(vocab: int, hidden: int, layers: int, seed: int):
    """A random Qwen3 (sdpa attention, untied head) of the given sizes."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=128,
        eos_token_id=7,
        pad_token_id=0,
        bos_token_id=None,
        tie_word_embeddings=False,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(config)


def toy_actor(
    est: EstimatorConfig,
    *,
    dtype: torch.dtype = torch.float64,
    vocab: int = 61,
    hidden: int = 32,
    layers: int = 2,
    lengths: tuple[int, ...] = (10, 6, 1, 3),
    logprob_chunk: int = 8,
):
    """A LoRA student (non-zero B) and a teacher, both small random Qwen3s, an ActorWorker at
    temperature 0.7 and a batch with every teacher column (sampled-token log-probs, top-k, final
    hidden states); rows of the given response lengths, one of them with a left-padded prompt.
    Returns (actor, batch)."""
    from peft import LoraConfig, get_peft_model

    from miniverl.workers.actor import ActorWorker

    student = get_peft_model(
        small_qwen3(vocab, hidden, layers, seed=0),
        LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, task_type="CAUSAL_LM"),
    ).to(dtype)
    teacher = small_qwen3(vocab, hidden, layers, seed=1).to(dtype).eval()
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, param in student.named_parameters():
            if "lora_B" in name:  # PEFT starts B at 0: a LoRA that changes nothing has no gradient to A
                param.copy_(torch.randn(param.shape, generator=g, dtype=dtype) * 0.3)
    B, R, P = len(lengths), max(lengths), 4
    prompts = torch.randint(1, vocab, (B, P), generator=g)
    prompt_mask = torch.ones(B, P, dtype=torch.long)
    prompt_mask[1 % B, :2] = 0  # a left-padded prompt
    response_mask = (torch.arange(R)[None] < torch.tensor(lengths)[:, None]).float()  # (B, R)
    responses = torch.randint(1, vocab, (B, R), generator=g) * response_mask.long()  # (B, R)
    batch = assemble(prompts, prompt_mask, responses, response_mask, torch.zeros(B, R), torch.arange(B))
    with torch.no_grad():
        t_hidden = response_hidden_states(teacher, batch)  # (B, R, H)
        t_log_probs = teacher.lm_head(t_hidden).log_softmax(-1)  # (B, R, V): a small vocabulary
    batch.teacher_hidden_states = t_hidden
    batch.teacher_logprobs = t_log_probs.gather(-1, responses[..., None]).squeeze(-1).float()
    batch.teacher_topk_logprobs, batch.teacher_ids = (t.contiguous() for t in t_log_probs.topk(TOPK, dim=-1))
    actor = ActorWorker(
        student,
        ActorConfig(),
        est,
        temperature=0.7,
        logprob_chunk=logprob_chunk,
        loss_scale_factor=R,
        teacher_heads=(teacher.lm_head,),
    )
    return actor, batch


def selection_peaks(family: dict, keep: float, vocab: int = 8192) -> dict[str, int]:
    """Peak bytes of one float32 toy update whose positions fit in one chunk of positions (the head's
    blocks scale with the positions it is given): `selection` (the selection pass alone, 0 without
    one), `loss` (the loss's forward + backward, the selection made beforehand), `whole` (the whole
    accumulate_gradients, the selection pass included). Each part on a fresh actor."""
    selection = TokenSelectionConfig(by="none" if keep == 1 else "entropy", keep=keep)
    peaks = {}
    for part in ("selection", "loss", "whole"):
        est = EstimatorConfig(**family, token_selection=selection)
        actor, batch = toy_actor(est, dtype=torch.float32, vocab=vocab, layers=1, lengths=SELECTION_LENGTHS)
        actor.logprob_chunk = len(SELECTION_LENGTHS) * max(SELECTION_LENGTHS)  # one chunk of positions
        rows = [len(SELECTION_LENGTHS)]
        if part == "selection":
            peaks[part] = peak_bytes(partial(actor.select_tokens, batch, rows)) if keep < 1 else 0
            continue
        if part == "loss":
            chosen = actor.select_tokens(batch, rows)  # outside the measurement; the update reuses it
            actor.select_tokens = lambda *_, chosen=chosen: chosen
        peaks[part] = peak_bytes(partial(actor.accumulate_gradients, batch, rows))
    return peaks


def chunked_topk_peaks(
    b: int = 4, t: int = 16, vocab: int = 4096, k: int = TOPK, chunk: int = 4, dtype: torch.dtype = torch.float32
) -> dict[str, int]:
    """Peak bytes of forward_kl_topk's forward + backward on (b, t, vocab) logits of `dtype`, with
    use_chunked_topk (chunks of `chunk` positions) and without, and the sizes they are read against."""
    g = torch.Generator().manual_seed(5)
    logits = (torch.randn(b, t, vocab, generator=g) * 2).to(dtype)  # (B, T, V)
    t_lp, t_ids = torch.log_softmax(torch.randn(b, t, vocab, generator=g), -1).topk(k, dim=-1)  # (B, T, k)
    mask = torch.ones(b, t)

    def step(est):
        leaf = logits.clone().requires_grad_(True)

        def run():
            loss, _, _ = forward_kl_topk(est, leaf, t_lp, t_ids, mask, **batch_normalisers(mask))
            loss.backward()

        return peak_bytes(run)

    common = dict(loss_mode="forward_kl_topk", topk=k)
    return {
        "chunked": step(EstimatorConfig(**common, use_chunked_topk=True, chunked_topk_chunk_size=chunk)),
        "unchunked": step(EstimatorConfig(**common)),
        "full_float32_tensor": b * t * vocab * 4,  # a (B, T, V) float32 log-softmax
        "logits_gradient": b * t * vocab * logits.element_size(),  # the one (B, T, V) tensor a backward needs
        "chunk_float32_tensor": chunk * vocab * 4,
    }


def markdown(result: dict) -> str:
    lines = [
        f"Loss memory (`{result['command']}`; {result['machine']}, torch {result['torch']}):",
        "",
        f"Token selection: one float32 update of {result['selection']['positions']} positions "
        f"({result['selection']['response_tokens']} response tokens, one chunk of positions), vocabulary "
        f"{result['selection']['vocab']}; MiB at peak of the loss's forward + backward (the selection made "
        "beforehand), and of the whole update (the selection pass included):",
        "",
        "| loss | "
        + " | ".join(f"keep {k}" for k in KEEPS)
        + " | whole update, "
        + " | ".join(f"keep {k}" for k in KEEPS)
        + " |",
        "|---|" + "---:|" * (2 * len(KEEPS)),
    ]
    for name, rows in result["selection"]["peaks"].items():
        all_tokens = rows["1.0"]["loss"]
        cells = [f"{rows['1.0']['loss'] / MIB:.2f}"] + [
            f"{rows[str(k)]['loss'] / MIB:.2f} ({rows[str(k)]['loss'] / all_tokens:.2f}×)" for k in KEEPS[1:]
        ]
        whole = [f"{rows[str(k)]['whole'] / MIB:.2f}" for k in KEEPS]
        lines.append(f"| `{name}` | " + " | ".join(cells + whole) + " |")
    topk = result["chunked_topk"]
    lines += [
        "",
        f"Chunked top-k: `forward_kl_topk` forward + backward on ({topk['shape']}) float32 logits, k = {TOPK}, "
        f"chunks of {topk['chunk']} positions: {topk['peaks']['chunked'] / MIB:.2f} MiB chunked, "
        f"{topk['peaks']['unchunked'] / MIB:.2f} MiB not; one (B, T, V) float32 tensor is "
        f"{topk['peaks']['full_float32_tensor'] / MIB:.2f} MiB, the logits' gradient "
        f"{topk['peaks']['logits_gradient'] / MIB:.2f} MiB.",
        "",
    ]
    return "\n".join(lines)


def run(args, out: Path) -> dict:
    """Measures both tables and writes losses.json and losses.md to `out` (bench.tables.result_folder)."""
    from miniverl.bench.tables import machine_facts

    started = time.perf_counter()
    torch.manual_seed(0)
    peaks = {name: {str(k): selection_peaks(family, k, args.vocab) for k in KEEPS} for name, family in FAMILIES.items()}
    b, t, chunk = 4, 16, 4
    machine = machine_facts(torch.device("cpu"))
    result = {
        "command": " ".join(["python -m miniverl.bench", *args.argv]),
        "machine": machine["device_name"],
        "torch": torch.__version__,
        "selection": {
            "vocab": args.vocab,
            "positions": len(SELECTION_LENGTHS) * max(SELECTION_LENGTHS),
            "response_tokens": sum(SELECTION_LENGTHS),
            "peaks": peaks,
        },
        "chunked_topk": {
            "shape": f"{b}, {t}, {args.vocab}",
            "chunk": chunk,
            "peaks": chunked_topk_peaks(b, t, args.vocab, TOPK, chunk),
        },
        "machine_facts": machine,
    }
    result["bench_seconds"] = round(time.perf_counter() - started, 2)
    (out / "losses.json").write_text(json.dumps(result, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    table = markdown(result)
    (out / "losses.md").write_text(table, encoding="utf-8")
    print(table)
    print(f"wrote {out / 'losses.json'} and {out / 'losses.md'} ({result['bench_seconds']} s)")
    return result
