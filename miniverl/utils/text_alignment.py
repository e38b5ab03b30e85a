"""One response in two tokenizations, aligned by its text: the groundwork of distilling from a
teacher whose tokenizer differs from the student's (not wired into the recipe yet).

The student samples token ids; their text is what both models are asked about. The teacher
tokenizes that text its own way, so its tokens and the student's rarely coincide one to one. Both
are cut into the finest spans whose boundaries fall at the same character of the text: by the
chain rule, the sum of a span's token log-probs is each model's log-probability of the span's text
as tokenized here (other tokenizations of the same text carry some probability too, so it is a lower
bound on the text's), and the two sums can be subtracted (a span-level k1) where token log-probs
cannot.

A boundary after a token is clean only where the decode of the tokens up to it is a prefix of the
whole text: a token that ends inside a character (byte fallback) has none and joins the next span.
A span is unaligned, never scored, where its text holds U+FFFD (bytes that decode to no character,
as a UTF-8 sequence cut by the length limit does at the end), where either side has a special token in it (a
special token means something to its own model only), or where the teacher's tokens do not decode
back to the student's text (a tokenizer that normalises spaces or Unicode): `span` is -1 there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

REPLACEMENT = "\ufffd"  # what a decode writes for bytes that are no character


@dataclass(frozen=True)
class Alignment:
    text: str  # the response's text (the student's tokens decoded; its final stop token excluded)
    teacher_ids: list[int]  # the teacher's tokens of that text (+ its stop token when the student stopped)
    student_span: list[int]  # per student response token: its span, or -1 (unaligned)
    teacher_span: list[int]  # per teacher token: its span, or -1 (unaligned)
    num_spans: int  # unaligned spans keep their numbers (their sums are 0): see `aligned`
    aligned: list[bool]  # per span: scored; a mean over spans must count only these

    @property
    def unaligned_student_tokens(self) -> int:
        return sum(1 for s in self.student_span if s < 0)


def clean_ends(tokenizer, ids: list[int], text: str) -> list[int | None]:
    """Per token, the length of the text decoded up to and including it, where that decode is a
    prefix of `text`; None where it is not (the token ends inside a character, or the tokenizer
    decodes to other text than `text`)."""
    ends = []
    for i in range(len(ids)):
        prefix = tokenizer.decode(ids[: i + 1], skip_special_tokens=False)
        ends.append(len(prefix) if text.startswith(prefix) else None)
    return ends


def special_ranges(tokenizer, ids: list[int], ends: list[int | None]) -> list[tuple[int, int]]:
    """The character ranges [start, end) of the special tokens among `ids` (those with a clean end)."""
    ranges, start = [], 0
    for token, end in zip(ids, ends):
        if end is None:
            continue
        if _is_special(tokenizer, token):
            ranges.append((start, end))
        start = end
    return ranges


def _is_special(tokenizer, token_id: int) -> bool:
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    return token_id in tokenizer.all_special_ids or bool(getattr(added.get(token_id), "special", False))


def assign_spans(ends: list[int | None], bounds: list[int], aligned: list[bool]) -> list[int]:
    """Each token's span: the first common boundary at or after the token's clean end (a token
    without one belongs with the tokens after it); -1 past the last boundary or in an unaligned span."""
    spans, k = [], 0
    pending = 0  # tokens waiting for a clean end
    for end in ends:
        pending += 1
        if end is None:
            continue
        while k < len(bounds) and bounds[k] < end:
            k += 1
        span = k if k < len(bounds) and aligned[k] else -1
        spans.extend([span] * pending)
        pending = 0
    spans.extend([-1] * pending)  # trailing tokens that never reach a clean end
    return spans


def align_response(
    student_tokenizer, response_ids: list[int], teacher_tokenizer, *, stopped: bool, teacher_stop_id: int | None
) -> Alignment:
    """Align one response. `response_ids`: the student's sampled tokens, its stop token last when
    `stopped`; the teacher's own stop token (`teacher_stop_id`) then scores as one span of its own
    against the student's."""
    text_ids = response_ids[:-1] if stopped else list(response_ids)
    text = student_tokenizer.decode(text_ids, skip_special_tokens=False)
    teacher_ids = teacher_tokenizer(text, add_special_tokens=False)["input_ids"]
    student_ends = clean_ends(student_tokenizer, text_ids, text)
    teacher_ends = clean_ends(teacher_tokenizer, teacher_ids, text)

    bounds = sorted({e for e in student_ends if e} & {e for e in teacher_ends if e})
    blocked = special_ranges(student_tokenizer, text_ids, student_ends)
    blocked += special_ranges(teacher_tokenizer, teacher_ids, teacher_ends)
    aligned, start = [], 0
    for end in bounds:
        piece = text[start:end]
        aligned.append(REPLACEMENT not in piece and not any(a < end and start < b for a, b in blocked))
        start = end

    student_span = assign_spans(student_ends, bounds, aligned)
    teacher_span = assign_spans(teacher_ends, bounds, aligned)
    num_spans = len(bounds)
    if stopped:  # the two stop tokens: one span
        if teacher_stop_id is None:
            student_span.append(-1)
        else:
            student_span.append(num_spans)
            teacher_span.append(num_spans)
            teacher_ids = [*teacher_ids, teacher_stop_id]
            num_spans += 1
            aligned = [*aligned, True]
    return Alignment(text, teacher_ids, student_span, teacher_span, num_spans, aligned)


def span_sums(values: torch.Tensor, span: list[int], num_spans: int) -> torch.Tensor:
    """(T,) per-token values -> (num_spans,) their sums per span; unaligned tokens (-1) left out."""
    index = torch.tensor(span, dtype=torch.long, device=values.device)
    keep = index >= 0
    sums = torch.zeros(num_spans, dtype=values.dtype, device=values.device)
    return sums.index_add(0, index[keep], values[keep])


def credit_to_tokens(span_values: torch.Tensor, span: list[int], how: str = "even") -> torch.Tensor:
    """(num_spans,) span values -> (T,) per student token: `even` splits each span's value equally
    over its tokens, `last` gives it all to the span's last token; 0 on unaligned tokens."""
    index = torch.tensor(span, dtype=torch.long, device=span_values.device)
    keep = index >= 0
    out = torch.zeros(len(span), dtype=span_values.dtype, device=span_values.device)
    if how == "even":
        counts = torch.zeros_like(span_values).index_add(0, index[keep], torch.ones_like(out[keep]))
        out[keep] = span_values[index[keep]] / counts[index[keep]]
    elif how == "last":
        last = {s: i for i, s in enumerate(span) if s >= 0}  # the highest position of each span
        for s, i in last.items():
            out[i] = span_values[s]
    else:
        raise ValueError(f"credit must be 'even' or 'last', got {how!r}")
    return out
