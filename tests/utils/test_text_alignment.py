"""One response in two tokenizations, aligned by its text (miniverl/utils/text_alignment.py): the
spans partition both sides over the same text, the same tokenizer gives today's per-token numbers,
and what cannot be scored as the student sampled it (a character cut in two, a special token, text
the teacher's tokenizer rewrites) is marked unaligned, never mis-scored."""

from __future__ import annotations

import json

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from miniverl.models.toy import IM_START, build_toy_tokenizer
from miniverl.utils.text_alignment import align_response, credit_to_tokens, span_sums

CORPUS = ["12 + 30 = 42", "the sea is blue and the sky is grey", "write one sentence", "héllo wörld"] * 20


def trained_bpe(lowercase: bool = False, byte_level: bool = True) -> PreTrainedTokenizerFast:
    """A BPE trained here on a few lines: another segmentation of the same text; byte-level (GPT-2's
    byte symbols) or over the corpus's characters (SentencePiece's word marks, no byte tokens)."""
    backend = Tokenizer(models.BPE(unk_token=None if byte_level else "<unk>"))
    if lowercase:
        backend.normalizer = normalizers.Lowercase()
    if byte_level:
        backend.pre_tokenizer, backend.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    else:
        backend.pre_tokenizer, backend.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
        alphabet = []
    trainer = trainers.BpeTrainer(vocab_size=320, initial_alphabet=alphabet, special_tokens=["<eos>", "<unk>"])
    backend.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>", unk_token="<unk>")


@pytest.fixture(scope="module")
def toy():
    return build_toy_tokenizer()


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_one_tokenizer_on_both_sides_gives_one_span_per_token_and_the_per_token_k1(toy):
    ids = [*encode(toy, "12 + 30 = 42, the sea"), toy.eos_token_id]
    a = align_response(toy, ids, toy, stopped=True, teacher_stop_id=toy.eos_token_id)
    assert a.teacher_ids == ids and a.student_span == a.teacher_span == list(range(len(ids)))
    generator = torch.Generator().manual_seed(0)
    student, teacher = (torch.randn(len(ids), generator=generator, dtype=torch.float64) for _ in range(2))
    k1 = span_sums(student, a.student_span, a.num_spans) - span_sums(teacher, a.teacher_span, a.num_spans)
    for how in ("even", "last"):
        assert torch.equal(credit_to_tokens(k1, a.student_span, how), student - teacher)


def test_two_tokenizers_cut_the_text_into_the_same_spans_and_the_sums_add_up(toy):
    bpe = trained_bpe()
    text = "the sea is blue, 12 + 30 = 42"
    ids = encode(toy, text)
    a = align_response(toy, ids, bpe, stopped=False, teacher_stop_id=None)
    assert a.text == text and a.teacher_ids == encode(bpe, text)
    assert len(a.teacher_ids) < len(ids)  # the BPE merges: another segmentation
    assert -1 not in a.student_span and -1 not in a.teacher_span
    for k in range(a.num_spans):  # each span is the same text on both sides
        mine = toy.decode([t for t, s in zip(ids, a.student_span) if s == k])
        theirs = bpe.decode([t for t, s in zip(a.teacher_ids, a.teacher_span) if s == k])
        assert mine == theirs and mine
    assert a.student_span == sorted(a.student_span) and a.teacher_span == sorted(a.teacher_span)
    values = torch.arange(1.0, len(ids) + 1, dtype=torch.float64)
    assert span_sums(values, a.student_span, a.num_spans).sum() == values.sum()


def test_a_character_over_two_byte_tokens_is_one_span(toy):
    bpe = trained_bpe()
    ids = encode(toy, "héllo")
    assert len(ids) == 6  # h, the two bytes of é, l, l, o
    a = align_response(toy, ids, bpe, stopped=False, teacher_stop_id=None)
    assert a.student_span[1] == a.student_span[2] >= 0 and a.unaligned_student_tokens == 0


def test_a_byte_that_is_no_character_is_scored_by_a_byte_level_teacher_as_that_byte(toy):
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    bpe = trained_bpe()
    ids = encode(toy, "the sé")[:-1]  # the length limit fell between the two bytes of é
    a = align_response(toy, ids, bpe, stopped=False, teacher_stop_id=None)
    assert a.text == "the s\udcc3"  # the byte kept as itself (surrogateescape), one character
    assert a.teacher_ids[-1] == bpe.get_vocab()[bytes_to_unicode()[0xC3]]  # the teacher's token of that byte
    assert a.unaligned_student_tokens == 0 and all(a.aligned)
    assert a.student_span[-1] == a.teacher_span[-1] == a.num_spans - 1  # a span of its own


def test_without_byte_tokens_on_both_sides_a_cut_character_is_left_unaligned(toy):
    sentencepiece_like = trained_bpe(byte_level=False)
    ids = encode(toy, "the sé")[:-1]
    a = align_response(toy, ids, sentencepiece_like, stopped=False, teacher_stop_id=None)
    assert a.text.endswith("\ufffd")  # decoded: the byte is lost
    assert a.student_span[-1] == -1 and a.unaligned_student_tokens == 1
    assert -1 not in a.student_span[:-1]


def test_text_the_teachers_tokenizer_rewrites_is_unaligned_from_where_it_differs(toy):
    lower = trained_bpe(lowercase=True)
    ids = encode(toy, "the sea Is blue")
    a = align_response(toy, ids, lower, stopped=False, teacher_stop_id=None)
    assert lower.decode(a.teacher_ids) == "the sea is blue"  # the teacher would score other text
    kept, changed = len(encode(toy, "the sea")), len(encode(toy, "the sea "))  # the teacher's " is" holds the space
    assert -1 not in a.student_span[:kept] and set(a.student_span[changed:]) == {-1}


def test_a_special_token_inside_the_response_is_never_scored(toy):
    bpe = trained_bpe()
    before, after = encode(toy, "the sea"), encode(toy, " is blue")
    ids = [*before, toy.convert_tokens_to_ids(IM_START), *after]
    a = align_response(toy, ids, bpe, stopped=False, teacher_stop_id=None)
    assert a.student_span[len(before)] == -1
    assert -1 not in a.student_span[: len(before)] and -1 not in a.student_span[len(before) + 1 :]
    covered = [t for t, s in zip(a.teacher_ids, a.teacher_span) if s == -1]
    assert IM_START in bpe.decode(covered)  # the teacher's tokens of that text are left out too


def test_the_stop_tokens_are_a_span_of_their_own_or_unaligned_without_a_teacher_stop(toy):
    bpe = trained_bpe()
    ids = [*encode(toy, "the sea"), toy.eos_token_id]
    a = align_response(toy, ids, bpe, stopped=True, teacher_stop_id=bpe.eos_token_id)
    assert a.teacher_ids[-1] == bpe.eos_token_id and a.student_span[-1] == a.teacher_span[-1] == a.num_spans - 1
    assert a.text == "the sea"
    b = align_response(toy, ids, bpe, stopped=True, teacher_stop_id=None)
    assert b.student_span[-1] == -1 and b.teacher_ids == encode(bpe, "the sea")


def test_a_span_value_goes_evenly_or_to_its_last_token_and_never_to_unaligned_ones():
    span = [0, 0, 1, -1, 2, 2, 2]
    values = torch.tensor([2.0, 5.0, 3.0])
    assert credit_to_tokens(values, span, "even").tolist() == [1.0, 1.0, 5.0, 0.0, 1.0, 1.0, 1.0]
    assert credit_to_tokens(values, span, "last").tolist() == [0.0, 2.0, 5.0, 0.0, 0.0, 0.0, 3.0]
    with pytest.raises(ValueError, match="credit must be"):
        credit_to_tokens(values, span, "first")


def test_a_character_the_teachers_vocabulary_cannot_write_is_a_hole_and_the_rest_still_aligns(toy):
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    bpe = trained_bpe()
    vocab = bpe.backend_tokenizer.get_vocab()
    backend = bpe.backend_tokenizer
    # A teacher vocabulary without a token for byte 0x16 (SmolLM2's lacks it): its tokenizer drops it.
    missing = bytes_to_unicode()[0x16]
    pruned = {t: i for t, i in vocab.items() if t != missing}
    merges = [m for m in json.loads(backend.to_str())["model"]["merges"] if missing not in "".join(m)]
    holed = Tokenizer(models.BPE(vocab=pruned, merges=[tuple(m) for m in merges]))
    holed.pre_tokenizer, holed.decoder = backend.pre_tokenizer, backend.decoder
    teacher = PreTrainedTokenizerFast(tokenizer_object=holed, eos_token="<eos>")
    assert teacher.decode(encode(teacher, "a\x16b")) == "ab"  # the character is gone
    ids = encode(toy, "the sea \x16 is blue")
    a = align_response(toy, ids, teacher, stopped=False, teacher_stop_id=None)
    at = len(encode(toy, "the sea "))
    # The character no teacher token writes, up to the teacher's next token end (" is"), is one unaligned span;
    # the text before and after it aligns.
    assert a.student_span[at : at + 4] == [-1] * 4
    assert -1 not in a.student_span[:at] and -1 not in a.student_span[at + 4 :]
    assert sum(a.hole_bytes) == 1 and not any(ok and n for ok, n in zip(a.aligned, a.hole_bytes))
    # Scored at a floor (teacher.unwritable_byte_log_prob): the character is a span of its own, with
    # no teacher token and one byte to score; every student token is aligned.
    scored = align_response(toy, ids, teacher, stopped=False, teacher_stop_id=None, score_holes=True)
    assert -1 not in scored.student_span and all(scored.aligned)
    hole = scored.student_span[at]
    assert scored.hole_bytes[hole] == 1 and sum(scored.hole_bytes) == 1
    assert hole not in scored.teacher_span and scored.teacher_ids == a.teacher_ids
    assert toy.decode([t for t, s in zip(ids, scored.student_span) if s == hole]).strip() == "\x16"
    assert (scored.floored_bytes, a.floored_bytes) == (1, 0)  # scored at the floor only with score_holes
    # At the response's first and last characters too: every token aligned, both bytes counted.
    for text in ("\x16the sea is blue\x16", "\x16\x16"):
        ids = encode(toy, text)
        scored = align_response(toy, ids, teacher, stopped=False, teacher_stop_id=None, score_holes=True)
        assert -1 not in scored.student_span and all(scored.aligned), text
        assert scored.floored_bytes == 2 and scored.text_bytes == len(text.encode()), text


@pytest.mark.parametrize("kind", ["sentencepiece-like", "lowercasing", "bytes"])
def test_the_incremental_clean_ends_are_those_of_decoding_every_prefix(toy, kind):
    from miniverl.utils.text_alignment import clean_ends

    tokenizer = {"sentencepiece-like": trained_bpe(byte_level=False), "lowercasing": trained_bpe(lowercase=True)}.get(
        kind, toy
    )
    for text in ("the sea is blue, héllo wörld 12 + 30 = 42", "The Sea  Is   BLUE"):
        ids = encode(tokenizer, text)
        for cut in (ids, ids[:-1], ids[: len(ids) // 2]):
            decoded = tokenizer.decode(cut, skip_special_tokens=False, clean_up_tokenization_spaces=False)
            for target in (decoded, text):  # the decode itself, and a text the tokenizer may not give back
                prefixes = [tokenizer.decode(cut[: i + 1], clean_up_tokenization_spaces=False) for i in range(len(cut))]
                expected = [len(p) if target.startswith(p) else None for p in prefixes]
                # The reference counts a prefix ending in U+FFFD (a cut character) as clean when the
                # target ends so too; the stream gives no end inside a character. Both leave it unaligned.
                expected = [None if p.endswith("\ufffd") else e for p, e in zip(prefixes, expected)]
                got = clean_ends(tokenizer, cut, target)
                # A token that adds no text (SentencePiece's lone word mark at the start) has no end of its
                # own in the stream: it joins the next token's span, where the reference puts it in the one
                # before; both keep the span sums over the same text.
                lengths = [0] + [len(p) for p in prefixes]
                for i, (g, e) in enumerate(zip(got, expected)):
                    assert g == e or (g is None and e == lengths[i]), (i, got, expected)
