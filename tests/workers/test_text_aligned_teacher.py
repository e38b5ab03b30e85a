"""A teacher with another tokenizer (teacher.tokenizer_alignment=text, workers/text_aligned_teacher.py):
it scores the response's text in its own tokens after its own prompt, as a plain Hugging Face
forward of it does; each model's span sums add up to its whole-sequence log-likelihood; what cannot
be aligned is left out of the loss and counted; the span estimators reach the student's tokens as
documented; with the same tokenizer the run is byte for byte the one without alignment."""

from __future__ import annotations

import json
import types

import pytest
import torch

from miniverl.config import to_config
from miniverl.models import toy
from miniverl.protocol import assemble, left_pad
from miniverl.trainer import preflight
from miniverl.trainer.metrics import alignment_metrics
from miniverl.trainer.runner import run
from miniverl.utils.errors import MiniverlError
from miniverl.utils.identity import sha256_file
from miniverl.utils.text_alignment import ByteTokens
from miniverl.verl_compat.launch_writer import export
from miniverl.workers.losses import Spans, kl_estimate, span_kl_estimate
from miniverl.workers.teacher import TeacherWorker
from miniverl.workers.text_aligned_teacher import TextAlignedTeacher

from conftest import ROOT, compose_config, trajectory

QUESTION = [{"role": "user", "content": "What is 12 + 30? Answer briefly."}]
RESPONSES = ("The answer is 42.", " 12 + 30 = 42, the sea")  # ASCII: every span aligns


@pytest.fixture(scope="module")
def pair():
    """The bytes tokenizer (the student's) and a teacher of the bpe tokenizer, random weights."""
    student_tok, teacher_tok = toy.build_toy_tokenizer("bytes"), toy.build_toy_tokenizer("bpe")
    arch = to_config(compose_config(["teacher.toy.tokenizer=bpe"])).teacher.toy
    teacher = toy.build_toy_model(arch, teacher_tok, seed=3).eval()
    return student_tok, teacher_tok, teacher


def prompt_of(tokenizer) -> list[int]:
    chat = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    return tokenizer(chat, add_special_tokens=False)["input_ids"]


def student_batch(student_tok, responses: list[list[int]]):
    """Rows of prompt row 0 with these sampled ids, right-padded (response_mask 0 past each)."""
    ids, mask = left_pad([prompt_of(student_tok)] * len(responses), student_tok.pad_token_id, torch.device("cpu"))
    width = max(len(r) for r in responses)
    out = torch.full((len(responses), width), student_tok.pad_token_id)
    response_mask = torch.zeros(len(responses), width)
    for i, r in enumerate(responses):
        out[i, : len(r)], response_mask[i, : len(r)] = torch.tensor(r), 1
    rows = torch.zeros(len(responses), dtype=torch.long)
    return assemble(ids, mask, out, response_mask, torch.zeros(len(responses), width), rows)


def aligned_teacher(pair, unwritable_byte_log_prob: float | None = None) -> TextAlignedTeacher:
    student_tok, teacher_tok, teacher = pair
    worker = TeacherWorker(
        teacher,
        logprob_chunk=4,
        topk=None,
        tokenizer_vocab=len(teacher_tok),
        pad_id=teacher_tok.pad_token_id,
        context_prompts={0: prompt_of(teacher_tok)},
    )
    return TextAlignedTeacher(
        worker,
        student_tok,
        teacher_tok,
        stop_ids=[student_tok.eos_token_id],
        credit="last",
        unwritable_byte_log_prob=unwritable_byte_log_prob,
    )


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def plain_log_probs(model, prompt: list[int], response: list[int]) -> torch.Tensor:
    """(n,) log-probs of `response` after `prompt` by one plain forward of one unpadded row."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response])).logits[0].float()
    n = len(response)
    return logits[len(prompt) - 1 : len(prompt) - 1 + n].log_softmax(-1)[torch.arange(n), response]


def test_the_teacher_scores_its_own_tokens_of_the_text_as_a_plain_forward_does(pair):
    student_tok, teacher_tok, teacher = pair
    stopped = [*encode(student_tok, RESPONSES[1]), student_tok.eos_token_id]
    batch = aligned_teacher(pair).compute_teacher_log_prob(
        student_batch(student_tok, [encode(student_tok, RESPONSES[0]), stopped]), rows_per_forward=2
    )
    for i, text in enumerate(RESPONSES):
        theirs = encode(teacher_tok, text) + ([teacher_tok.eos_token_id] if i == 1 else [])
        assert len(theirs) < len(encode(student_tok, text))  # another, coarser tokenization
        expected = plain_log_probs(teacher, prompt_of(teacher_tok), theirs)
        torch.testing.assert_close(batch.teacher_text_logprobs[i], expected.sum(), atol=1e-4, rtol=0)
        # Every span aligns here: the spans' log-probs are the whole text's, split.
        torch.testing.assert_close(batch.teacher_span_logprobs[i].sum(), expected.sum(), atol=1e-4, rtol=0)
        assert int(batch.response_chars[i]) == len(text)
    assert torch.equal(batch.scored_mask, batch.response_mask)


def test_each_models_span_sums_add_up_to_its_whole_sequence_log_likelihood(pair):
    student_tok, teacher_tok, _ = pair
    student = toy.build_toy_model(
        to_config(compose_config([])).model.toy, student_tok, seed=5
    ).eval()  # a student of the bytes tokenizer
    ids = encode(student_tok, RESPONSES[1])
    batch = aligned_teacher(pair).compute_teacher_log_prob(student_batch(student_tok, [ids]), rows_per_forward=1)
    own = plain_log_probs(student, prompt_of(student_tok), ids)  # (n,)
    spans = batch.student_span[0]
    student_spans = torch.zeros(batch.teacher_span_logprobs.shape[1]).index_add(0, spans, own)
    torch.testing.assert_close(student_spans.sum(), own.sum(), atol=1e-5, rtol=0)
    assert len(set(spans.tolist())) == batch.teacher_span_logprobs.shape[1] < len(ids)  # spans of several bytes
    torch.testing.assert_close(batch.teacher_span_logprobs.sum(), batch.teacher_text_logprobs.sum(), atol=1e-5, rtol=0)
    # "last": a span's teacher log-prob sits on its last student token; the row sums to the text's.
    ends = torch.cat([spans[1:] != spans[:-1], torch.tensor([True])])
    assert torch.equal(batch.teacher_logprobs[0] != 0, ends)
    torch.testing.assert_close(batch.teacher_logprobs.sum(), batch.teacher_text_logprobs.sum(), atol=1e-5, rtol=0)


def test_a_cut_character_is_scored_by_its_byte_and_a_special_token_is_left_out_and_counted(pair):
    student_tok, _, _ = pair
    cut = encode(student_tok, "the sea é")[:-1]  # the last character's first byte only
    im_start = student_tok.convert_tokens_to_ids(toy.IM_START)
    special = [*encode(student_tok, "the sea "), im_start, *encode(student_tok, "is")]
    batch = aligned_teacher(pair).compute_teacher_log_prob(student_batch(student_tok, [cut, special]), 2)
    unscored = batch.response_mask - batch.scored_mask  # (B, R)
    assert unscored[0].sum() == 0  # both tokenizers are byte-level: the teacher scores the lone byte
    assert unscored[1, len(special) - 3] == 1  # the special token's span
    assert (batch.teacher_logprobs * unscored).abs().sum() == 0  # never scored
    fraction = alignment_metrics(batch)["distillation/unaligned_fraction"]
    assert fraction == pytest.approx(float(unscored.sum() / batch.response_mask.sum()))


def test_bytes_the_teacher_cannot_write_cost_the_floor_per_byte_where_one_is_set(pair, monkeypatch):
    """SmolLM2's vocabulary lacks 21 bytes (0x16 among them): left out, a student that writes them
    escapes the loss (recipes/opd_k1_cross_tokenizer_cpu/README.md); teacher.unwritable_byte_log_prob
    scores each at that log-probability instead, and everything else as before."""
    student_tok, _, _ = pair
    writes = ByteTokens.writes
    monkeypatch.setattr(ByteTokens, "writes", lambda self, char: char != "\x16" and writes(self, char))
    text = "the sea \x16\x16 is blue"
    ids = encode(student_tok, text)
    left_out = aligned_teacher(pair).compute_teacher_log_prob(student_batch(student_tok, [ids]), 1)
    floored = aligned_teacher(pair, -20.0).compute_teacher_log_prob(student_batch(student_tok, [ids]), 1)
    assert (left_out.response_mask - left_out.scored_mask).sum() >= 2  # the two bytes' span, unscored
    assert torch.equal(floored.scored_mask, floored.response_mask)  # every token scored
    torch.testing.assert_close(floored.teacher_text_logprobs, left_out.teacher_text_logprobs)  # the same teacher pass
    expected = floored.teacher_text_logprobs.sum() + 2 * -20.0  # its tokens' log-probs and two bytes at the floor
    torch.testing.assert_close(floored.teacher_span_logprobs.sum(), expected, atol=1e-4, rtol=0)
    torch.testing.assert_close(floored.teacher_logprobs.sum(), expected, atol=1e-4, rtol=0)  # credited to tokens
    # The share of the text's bytes scored at the floor, logged with the floor only.
    text_bytes = len(text.encode())
    assert (int(floored.unwritable_bytes[0]), int(floored.response_bytes[0])) == (2, text_bytes)
    assert alignment_metrics(floored)["distillation/unwritable_byte_fraction"] == pytest.approx(2 / text_bytes)
    assert left_out.unwritable_bytes is None and "distillation/unwritable_byte_fraction" not in alignment_metrics(
        left_out
    )


@pytest.mark.parametrize("mode", ["k1", "k3"])
@pytest.mark.parametrize("credit", ["last", "even"])
def test_a_spans_estimate_reaches_its_student_tokens_as_documented(mode, credit):
    span = torch.tensor([[0, 0, 1, 2, 2, 2, -1, -1]])  # (1, 8): three spans, two padding/unaligned tokens
    log_prob = torch.tensor([[-1.0, -2.0, -0.5, -0.1, -0.2, -0.3, -9.0, -9.0]], requires_grad=True)
    teacher = torch.tensor([[-1.5, -1.0, -0.2]])  # (1, S)
    per_token = span_kl_estimate(log_prob, Spans(span, teacher, credit), mode)
    expected = kl_estimate(torch.tensor([[-3.0, -0.5, -0.6]]), teacher, mode)[0].tolist()  # per span
    if credit == "last":
        assert per_token[0].tolist() == pytest.approx([0, expected[0], expected[1], 0, 0, expected[2], 0, 0])
    else:
        shares = [expected[0] / 2] * 2 + [expected[1]] + [expected[2] / 3] * 3 + [0, 0]
        assert per_token[0].tolist() == pytest.approx(shares)
    per_token.sum().backward()  # a direct loss trains every token of a span through the span's sum
    assert (log_prob.grad[0, :6] != 0).all() and (log_prob.grad[0, 6:] == 0).all()


@pytest.mark.parametrize("mode", ["k1", "k2", "k3", "abs"])
def test_one_token_spans_give_the_per_token_estimate_bit_for_bit(mode):
    log_prob, teacher = torch.randn(3, 7, dtype=torch.float64), torch.randn(3, 7, dtype=torch.float64)
    span = torch.arange(7).expand(3, 7)  # what one tokenizer on both sides gives
    for credit in ("last", "even"):
        per_token = span_kl_estimate(log_prob, Spans(span, teacher, credit), mode)
        assert torch.equal(per_token, kl_estimate(log_prob, teacher, mode))


RUN = ["+recipe=opd_k1", "model=toy", "teacher=toy", "recipe.optimizer_updates=2", "recipe.logical_batch=2"]
RUN += ["recipe.response_limit=8", "recipe.interrupt_after_updates=null", "eval.every=-1", "data.val_files=[]"]
RUN += ["trainer.progress_bar=false"]


@pytest.mark.slow
def test_with_the_same_tokenizer_the_run_is_byte_identical_to_the_one_without_alignment(tmp_path):
    aligned = ["teacher.tokenizer_alignment=text", "teacher.unwritable_byte_log_prob=-20"]  # no floor to apply
    for name, extra in (("plain", []), ("aligned", aligned)):
        assert run(compose_config([*RUN, *extra]), tmp_path / name)["status"] == "measured"
    for file in ("trajectories/update_000001.safetensors", "trajectories/update_000002.safetensors",
                 "peft_adapter/adapter_model.safetensors"):  # fmt: skip
        assert sha256_file(tmp_path / "aligned" / file) == sha256_file(tmp_path / "plain" / file)
    block = json.loads((tmp_path / "aligned" / "report.json").read_text())["tokenizer_alignment"]
    assert block["applied"].startswith("none") and block["teacher_tokenizer"] is None
    assert block["unwritable_byte_log_prob"] is None and block["unwritable_byte_fraction_mean"] is None


CROSS = [*RUN, "teacher.toy.tokenizer=bpe", "teacher.tokenizer_alignment=text"]


@pytest.mark.slow
@pytest.mark.parametrize("floor", [None, -20.0])
def test_a_teacher_of_another_tokenizer_trains_and_resumes_exactly(tmp_path, floor):
    whole, stopped = tmp_path / "whole", tmp_path / "stopped"
    args = [*CROSS, "eval.every=2", "data.val_files=[data/toy_prompts_heldout.parquet]"]
    args += [] if floor is None else [f"teacher.unwritable_byte_log_prob={floor}"]
    report = run(compose_config(args), whole)
    assert report["status"] == "measured"
    block = report["tokenizer_alignment"]
    assert block["applied"] == "text"
    assert block["teacher_tokenizer"]["vocabulary"] == len(toy.build_toy_tokenizer("bpe"))
    assert 0 <= block["unaligned_fraction_mean"] < 1
    progress = report["distillation_progress"]
    assert progress["exact_reverse_kl"] is None and len(progress["teacher_loglik_per_char"]) == 2
    t = trajectory(whole, 1)
    assert t["student_span"].shape == t["responses"].shape and t["teacher_span_logprobs"].dim() == 2
    # With a floor, how much of the text it scored: per row in the trajectory log, over the updates in the report.
    assert block["unwritable_byte_log_prob"] == floor
    assert (block["unwritable_byte_fraction_mean"] is None) == (floor is None) == ("unwritable_bytes" not in t)
    if floor is not None:
        assert t["response_bytes"].shape == t["unwritable_bytes"].shape == t["prompt_rows"].shape
        assert int(t["response_bytes"].sum()) > 0 and bool((t["unwritable_bytes"] <= t["response_bytes"]).all())
    assert run(compose_config([*args, "trainer.stop_after_updates=1"]), stopped)["status"] == "interrupted"
    assert run(compose_config(args), stopped)["status"] == "measured"
    for file in ("trajectories/update_000002.safetensors", "peft_adapter/adapter_model.safetensors"):
        assert sha256_file(stopped / file) == sha256_file(whole / file)


def test_a_teacher_of_another_tokenizer_without_alignment_is_refused_saying_how_to_enable_it(tmp_path):
    with pytest.raises(MiniverlError) as error:
        run(compose_config([*RUN, "teacher.toy.tokenizer=bpe"]), tmp_path / "run")
    message = str(error.value)
    assert "tokenizer vocabularies differ" in message and "set teacher.tokenizer_alignment=text" in message
    assert "\n" not in message and not (tmp_path / "run").exists()


def test_the_doctor_measures_how_much_of_the_datas_text_aligns():
    cfg = to_config(compose_config(CROSS))
    check = preflight.check_tokenizers(cfg, toy.build_toy_tokenizer("bytes"))
    assert check.status == "PASS" and "align 100.0% of the student's" in check.reason


@pytest.mark.parametrize(
    "extra,message",
    [
        (["estimator=reverse_kl_full"], "teacher.tokenizer_alignment=text scores sampled tokens only"),
        (["teacher.mode=ref"], "teacher.tokenizer_alignment=text needs a separate teacher model"),
        (["teacher.alignment_credit=first"], "teacher.alignment_credit='first'; choose one of last, even"),
        (["teacher.unwritable_byte_log_prob=0"], "teacher.unwritable_byte_log_prob=0.0: a finite log-probability"),
        (["teacher.unwritable_byte_log_prob=-inf"], "teacher.unwritable_byte_log_prob=-inf: a finite log-probability"),
        (
            ["+teacher@teachers.a=toy", "teachers.a.key=x", "teachers.a.tokenizer_alignment=text"],
            "teachers.a.tokenizer_alignment=text works with the single `teacher`",
        ),
        (["estimator.use_task_rewards=true"], "do not combine yet"),
    ],
)
def test_what_alignment_cannot_combine_with_is_one_line(extra, message):
    with pytest.raises(MiniverlError, match=message):
        to_config(compose_config([*CROSS, *extra]))


def test_the_export_refuses_alignment_in_one_line(tmp_path):
    with pytest.raises(MiniverlError, match="verl 0.9.1 has no distillation across tokenizers") as error:
        export(compose_config(CROSS), tmp_path / "out", cwd=ROOT)
    assert "\n" not in str(error.value)


def teacher_stop_id(teacher_tokenizer) -> int:
    worker = types.SimpleNamespace(weight_bytes=0)  # the stop is read from the tokenizer alone
    return TextAlignedTeacher(worker, None, teacher_tokenizer, stop_ids=[], credit="last").teacher_stop_id


def test_the_teachers_stop_is_the_token_its_template_ends_a_turn_with_not_always_its_eos():
    chatml = toy.build_toy_tokenizer("bpe")
    assert teacher_stop_id(chatml) == chatml.convert_tokens_to_ids(toy.IM_END)
    gemma_like = toy.build_toy_tokenizer("bpe")
    gemma_like.add_special_tokens({"additional_special_tokens": ["<end_of_turn>"]})
    gemma_like.eos_token = toy.PAD  # Gemma: <eos> ends the text, <end_of_turn> the turn
    gemma_like.chat_template = (
        "{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] }}<end_of_turn>\n{% endfor %}"
    )
    assert teacher_stop_id(gemma_like) == gemma_like.convert_tokens_to_ids("<end_of_turn>") != gemma_like.eos_token_id


def test_a_special_tokens_name_spelt_out_by_the_student_is_text_to_the_teacher(pair):
    student_tok, teacher_tok, _ = pair
    ids = encode(student_tok, "the sea")
    ids += [i for c in "<|im_end|>" for i in encode(student_tok, c)]  # ordinary byte tokens, not the special one
    batch = aligned_teacher(pair).compute_teacher_log_prob(student_batch(student_tok, [ids]), rows_per_forward=1)
    assert torch.equal(batch.scored_mask, batch.response_mask)  # scored as the characters they are
