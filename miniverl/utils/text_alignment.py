"""One response in two tokenizations, aligned by its text: what lets a teacher whose tokenizer
differs from the student's score the student's samples (teacher.tokenizer_alignment=text;
workers/text_aligned_teacher.py builds on it, docs/teachers.md says what it does).

The student samples token ids; their text is what both models are asked about. The teacher
tokenizes that text its own way, so its tokens and the student's rarely coincide one to one. Both
are cut into the finest spans whose boundaries fall at the same character of the text: by the
chain rule, the sum of a span's token log-probs is each model's log-probability of the span's text
as tokenized here (other tokenizations of the same text carry some probability too, so it is a lower
bound on the text's), and the two sums can be subtracted (a span-level k1) where token log-probs
cannot.

A boundary after a token is clean only where the text up to it is a prefix of the whole text
ending on a character: a token that ends inside a character (byte fallback) has none and joins the
next span. Where both tokenizers are byte-level BPE (GPT-2's byte symbols: Llama 3, Qwen, SmolLM,
GPT-2), the text is the student's exact bytes, a byte that is no character kept as itself (as a
UTF-8 sequence cut by the length limit, or a student that writes raw bytes), and the teacher scores
such bytes with its own byte tokens: every byte the student writes is scored. Otherwise the text is
the student's decode, and a span holding U+FFFD (bytes the decode could not keep) is unaligned. A
character the teacher's vocabulary cannot write (a hole) makes its span unaligned too, unless the
caller scores holes at a floor (`score_holes`: teacher.unwritable_byte_log_prob). A
span is unaligned, never scored, also where either side has a special token in it (a special token
means something to its own model only) or where the teacher's tokens do not give back the student's
text (a tokenizer that normalises spaces or Unicode): `span` is -1 there. Why the bytes matter: a
student that could write unscored bytes would be trained on everything but them, and drifts there
(measured: recipes/opd_k1_cross_tokenizer_cpu/README.md).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from tokenizers.decoders import DecodeStream

REPLACEMENT = "\ufffd"  # what a decode writes for bytes that are no character
# The teacher reads the student's text as text: a special token's name the student spelt out with
# ordinary tokens stays those characters (a student special token is blocked on its own side).
AS_TEXT = {"add_special_tokens": False, "split_special_tokens": True}


@dataclass(frozen=True)
class Alignment:
    text: str  # the response's text (the student's tokens decoded; its final stop token excluded)
    teacher_ids: list[int]  # the teacher's tokens of that text (+ its stop token when the student stopped)
    student_span: list[int]  # per student response token: its span, or -1 (unaligned)
    teacher_span: list[int]  # per teacher token: its span, or -1 (unaligned)
    num_spans: int  # unaligned spans keep their numbers (their sums are 0): see `aligned`
    aligned: list[bool]  # per span: scored; a mean over spans must count only these
    hole_bytes: list[int]  # per span: bytes the teacher cannot write (scored at a floor with `score_holes`)

    @property
    def unaligned_student_tokens(self) -> int:
        return sum(1 for s in self.student_span if s < 0)

    @property
    def text_bytes(self) -> int:
        """The response text's bytes (a byte kept as itself counts one)."""
        return len(_bytes_of(self.text))

    @property
    def floored_bytes(self) -> int:
        """The bytes the teacher cannot write inside aligned spans: those a floor scores."""
        return sum(n for n, kept in zip(self.hole_bytes, self.aligned) if kept)


def clean_ends(tokenizer, ids: list[int], text: str) -> list[int | None]:
    """Per token, the length of the text decoded up to and including it, where that decode is a
    prefix of `text`; None where it is not (the token ends inside a character, or the tokenizer
    decodes to other text than `text`). Incremental (the tokenizers library's DecodeStream: one step
    per token); a tokenizer without a Rust backend decodes every prefix (quadratic)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        prefixes = (tokenizer.decode(ids[: i + 1], skip_special_tokens=False) for i in range(len(ids)))
        return [len(p) if text.startswith(p) else None for p in prefixes]
    stream, ends, length, same = DecodeStream(skip_special_tokens=False), [], 0, True
    for token in ids:
        chunk = stream.step(backend, token)  # None: the token ends inside a character
        if chunk is not None:
            same = same and text.startswith(chunk, length)
            length += len(chunk)
        ends.append(length if chunk is not None and same else None)
    return ends


class ByteTokens:
    """A byte-level BPE tokenizer's tokens as bytes (GPT-2's byte-to-symbol table, which Llama 3,
    Qwen, SmolLM and GPT-2 share). A vocabulary may lack some bytes' own tokens (SmolLM2's has no
    token for 21 bytes, control characters among them, and its tokenizer drops such characters):
    text holding one cannot be written by that model at all."""

    _cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> its ByteTokens or None

    def __init__(self, tokenizer):
        from transformers.convert_slow_tokenizer import bytes_to_unicode

        symbol_of = bytes_to_unicode()  # byte -> its one-character symbol in the vocabulary
        self.byte_of = {symbol: byte for byte, symbol in symbol_of.items()}
        self.tokenizer = weakref.proxy(tokenizer)  # not a strong one: the cache's entry goes with the tokenizer
        vocab = tokenizer.get_vocab()
        self.byte_ids = {b: vocab[symbol_of[b]] for b in range(256) if symbol_of[b] in vocab}  # each byte's token

    @classmethod
    def of(cls, tokenizer) -> ByteTokens | None:
        """The tokenizer's ByteTokens, or None when it is not byte-level (no ByteLevel decoder)."""
        if tokenizer not in cls._cache:
            backend = getattr(tokenizer, "backend_tokenizer", None)
            byte_level = type(getattr(backend, "decoder", None)).__name__ == "ByteLevel"
            cls._cache[tokenizer] = cls(tokenizer) if byte_level else None
        return cls._cache[tokenizer]

    def bytes_of(self, ids: list[int]) -> list[bytes]:
        """Each token's bytes (an added token's: its text in UTF-8)."""
        added = self.tokenizer.added_tokens_decoder
        out = []
        for token_id, symbols in zip(ids, self.tokenizer.convert_ids_to_tokens(ids)):
            if token_id in added or any(c not in self.byte_of for c in symbols):
                out.append(symbols.encode("utf-8"))
            else:
                out.append(bytes(self.byte_of[c] for c in symbols))
        return out

    def writes(self, char: str) -> bool:
        """Whether this vocabulary has a token for each byte of `char` (an escaped byte: that byte)."""
        return all(b in self.byte_ids for b in _bytes_of(char))


def by_bytes(text_ids: list[int], student: ByteTokens, teacher_tokenizer, teacher: ByteTokens):
    """Both sides byte-level: (text, student ends, teacher ids, teacher ends, holes). The text is
    the student's bytes, each byte that is no character kept as itself (Python's surrogateescape:
    one character each). The teacher tokenizes it run by run: ordinary text with its tokenizer,
    escaped bytes with its own byte tokens, and characters its vocabulary cannot write are holes
    ((start, end) character ranges: unaligned, never scored). Each run starts clean, so a run the
    teacher's tokenizer rewrites (a normaliser) leaves only that run unaligned."""
    pieces = student.bytes_of(text_ids)
    raw = b"".join(pieces)
    text = raw.decode("utf-8", "surrogateescape")
    char_at = {0: 0}  # byte offset of every character boundary -> its character offset
    offset = 0
    for i, char in enumerate(text):
        offset += len(_bytes_of(char))
        char_at[offset] = i + 1
    teacher_ids, teacher_ends, holes, start = [], [], [], 0
    for run, kind in _runs(text, teacher):
        end = start + len(run)
        if kind == "hole":
            holes.append((start, end))
        else:
            if kind == "text":
                ids = teacher_tokenizer(run, **AS_TEXT)["input_ids"]
            else:  # bytes that are no character: the teacher's own token of each
                ids = [teacher.byte_ids[b] for b in _bytes_of(run)]
            begin = len(_bytes_of(text[:start]))
            teacher_ends += _ends(teacher.bytes_of(ids), raw[: begin + len(_bytes_of(run))], char_at, begin)
            teacher_ids += ids
        start = end
    return text, _ends(pieces, raw, char_at), teacher_ids, teacher_ends, holes


def _runs(text: str, teacher: ByteTokens):
    """Maximal runs of one kind, in order: (run, kind); kind `text` (ordinary characters the teacher
    writes), `bytes` (escaped bytes it writes) or `hole` (what it cannot write)."""

    def kind(char: str) -> str:
        return "hole" if not teacher.writes(char) else "bytes" if _escaped(char) else "text"

    start = 0
    for i in range(1, len(text) + 1):
        if i == len(text) or kind(text[i]) != kind(text[start]):
            yield text[start:i], kind(text[start])
            start = i


def _escaped(char: str) -> bool:
    return "\udc80" <= char <= "\udcff"


def _bytes_of(text: str) -> bytes:
    return text.encode("utf-8", "surrogateescape")


def _ends(pieces: list[bytes], raw: bytes, char_at: dict[int, int], begin: int = 0) -> list[int | None]:
    """Per token, the character offset its bytes end at, where the bytes from `begin` on are a
    prefix of `raw`'s ending on a character boundary; None elsewhere (inside a character, or past a
    difference)."""
    ends, offset, same = [], begin, True
    for piece in pieces:
        same = same and raw[offset : offset + len(piece)] == piece
        offset += len(piece)
        ends.append(char_at.get(offset) if same else None)
    return ends


def special_ranges(tokenizer, ids: list[int], ends: list[int | None]) -> list[tuple[int, int]]:
    """The character ranges [start, end) of the special tokens among `ids` (those with a clean end)."""
    ranges, start = [], 0
    for token, end in zip(ids, ends):
        if end is None:
            continue
        if is_special_token(tokenizer, token):
            ranges.append((start, end))
        start = end
    return ranges


def is_special_token(tokenizer, token_id: int) -> bool:
    """A special token of `tokenizer` (its named ones, or an added token marked special), not text."""
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
    student_tokenizer,
    response_ids: list[int],
    teacher_tokenizer,
    *,
    stopped: bool,
    teacher_stop_id: int | None,
    score_holes: bool = False,
) -> Alignment:
    """Align one response. `response_ids`: the student's sampled tokens, its stop token last when
    `stopped`; the teacher's own stop token (`teacher_stop_id`) then scores as one span of its own
    against the student's. `score_holes`: characters the teacher cannot write stay in aligned spans,
    each counted in `hole_bytes` (the caller scores them at a floor), and a hole's end is a boundary
    on the teacher's side (it starts its next run clean); else such spans are unaligned."""
    text_ids = response_ids[:-1] if stopped else list(response_ids)
    student_bytes, teacher_bytes = ByteTokens.of(student_tokenizer), ByteTokens.of(teacher_tokenizer)
    byte_level = student_bytes is not None and teacher_bytes is not None
    holes = []  # character ranges the teacher cannot write
    if byte_level:
        text, student_ends, teacher_ids, teacher_ends, holes = by_bytes(
            text_ids, student_bytes, teacher_tokenizer, teacher_bytes
        )
    else:
        text = student_tokenizer.decode(text_ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        teacher_ids = teacher_tokenizer(text, **AS_TEXT)["input_ids"]
        student_ends = clean_ends(student_tokenizer, text_ids, text)
        teacher_ends = clean_ends(teacher_tokenizer, teacher_ids, text)

    teacher_clean = {e for e in teacher_ends if e}
    # A scored hole ends a span where the teacher's text before it ends clean (a normaliser's run does not).
    teacher_clean |= {b for a, b in holes if score_holes and (a == 0 or a in teacher_clean)}
    bounds = sorted({e for e in student_ends if e} & teacher_clean)
    blocked = special_ranges(student_tokenizer, text_ids, student_ends)
    blocked += special_ranges(teacher_tokenizer, teacher_ids, teacher_ends) + ([] if score_holes else holes)
    aligned, hole_bytes, start = [], [], 0
    for end in bounds:
        piece = text[start:end]
        cut = not byte_level and REPLACEMENT in piece  # bytes the decode could not keep
        aligned.append(not cut and not any(a < end and start < b for a, b in blocked))
        hole_bytes.append(
            sum(len(_bytes_of(text[max(a, start) : min(b, end)])) for a, b in holes if a < end and start < b)
        )
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
            aligned, hole_bytes = [*aligned, True], [*hole_bytes, 0]
    return Alignment(text, teacher_ids, student_span, teacher_span, num_spans, aligned, hole_bytes)


def span_sums(values: torch.Tensor, span, num_spans: int) -> torch.Tensor:
    """(T,) or (B, T) per-token values -> (num_spans,) or (B, num_spans) their sums per span, on
    the autograd graph of `values`; tokens of span -1 (unaligned, padding) are left out."""
    squeeze = values.dim() == 1
    index = torch.as_tensor(span, dtype=torch.long, device=values.device)
    index, values = (index[None], values[None]) if squeeze else (index, values)  # (B, T) each
    keep = index >= 0
    sums = values.new_zeros(len(values), num_spans)
    sums = sums.scatter_add(1, index.clamp_min(0), torch.where(keep, values, torch.zeros_like(values)))
    return sums[0] if squeeze else sums


def credit_to_tokens(span_values: torch.Tensor, span, how: str = "even") -> torch.Tensor:
    """(num_spans,) or (B, num_spans) span values -> (T,) or (B, T) per student token: `even`
    splits each span's value equally over its tokens, `last` gives it all to the span's last token
    (a span's tokens are adjacent); 0 on tokens of span -1."""
    squeeze = span_values.dim() == 1
    index = torch.as_tensor(span, dtype=torch.long, device=span_values.device)
    index, span_values = (index[None], span_values[None]) if squeeze else (index, span_values)  # (B, T), (B, S)
    keep = index >= 0
    at = index.clamp_min(0)
    value = span_values.gather(1, at)  # (B, T) each token's span value
    zero = torch.zeros_like(value)
    if how == "even":
        counts = torch.zeros_like(span_values).scatter_add(1, at, keep.to(span_values.dtype))  # (B, S)
        out = torch.where(keep, value / counts.gather(1, at).clamp_min(1), zero)
    elif how == "last":
        following = torch.cat([index[:, 1:], torch.full_like(index[:, :1], -2)], dim=1)
        out = torch.where(keep & (following != index), value, zero)
    else:
        raise ValueError(f"credit must be 'even' or 'last', got {how!r}")
    return out[0] if squeeze else out
