"""Teacher role for a teacher with another tokenizer (`teacher.tokenizer_alignment: text`).

Its log-probs of the student's token ids would mean nothing: its ids are other tokens. So each
response is decoded to text, the teacher scores that text in its own tokenization after the prompt
in its own chat template, and both tokenizations are cut into the finest spans whose boundaries
fall at the same character (miniverl/utils/text_alignment.py). A span's log-probability is the sum
of its tokens' under either model, so the two can be subtracted: the actor's estimators run on
spans (`student_span`, `teacher_span_logprobs`) and credit each span's value to its student tokens
(`alignment_credit`). Spans that cannot be aligned are left out and counted
(`distillation/unaligned_fraction`).

With the same tokenizer on both sides this worker is not built: the plain TeacherWorker scores the
student's own ids, and the run is byte for byte the one without alignment (workers/factory.py).
"""

from __future__ import annotations

import copy

import torch

from miniverl.models.tokenizers import assistant_turn_end
from miniverl.protocol import Batch, assemble, left_pad
from miniverl.utils.text_alignment import Alignment, align_response, credit_to_tokens, span_sums
from miniverl.workers.teacher import TeacherWorker


class TextAlignedTeacher:
    def __init__(
        self,
        worker: TeacherWorker,
        student_tokenizer,
        teacher_tokenizer,
        *,
        stop_ids,
        credit: str,
        unwritable_byte_log_prob: float | None = None,
    ):
        """`worker`: the teacher model's own worker (its vocabulary, pad id, and `context_prompts`: every
        row's prompt in the teacher's chat template); `stop_ids`: the ids that end a student response;
        `unwritable_byte_log_prob`: the teacher's log-prob of a byte its vocabulary cannot write (None:
        such spans are unaligned)."""
        self.worker = worker
        self.unwritable_byte_log_prob = unwritable_byte_log_prob
        self.student_tokenizer, self.teacher_tokenizer = student_tokenizer, teacher_tokenizer
        self.stop_ids = set(stop_ids)
        # Scored against the student's stop token: the teacher's own end of turn (Gemma's <end_of_turn>, ChatML's
        # <|im_end|>), which can differ from its EOS.
        turn_end = assistant_turn_end(teacher_tokenizer)
        self.teacher_stop_id = teacher_tokenizer.eos_token_id if turn_end is None else turn_end
        self.credit = credit
        self.weight_bytes = worker.weight_bytes

    def for_prompts(self, context_prompts: dict[int, list[int]] | None) -> TextAlignedTeacher:
        """This teacher with the prompts of other rows (the held-out prompts', in its own template)."""
        other = copy.copy(self)
        other.worker = self.worker.for_prompts(context_prompts)
        return other

    def align(self, batch: Batch) -> list[Alignment]:
        """Each row's response aligned by its text (the student's ids up to its last response token)."""
        alignments = []
        for ids, n in zip(batch.responses.tolist(), batch.response_mask.sum(-1).long().tolist()):
            ids = ids[:n]
            stopped = bool(ids) and ids[-1] in self.stop_ids
            alignments.append(
                align_response(
                    self.student_tokenizer,
                    ids,
                    self.teacher_tokenizer,
                    stopped=stopped,
                    teacher_stop_id=self.teacher_stop_id,
                    score_holes=self.unwritable_byte_log_prob is not None,
                )
            )
        return alignments

    def teacher_batch(self, batch: Batch, alignments: list[Alignment]) -> Batch:
        """The teacher's tokens of each response after the teacher's own prompt of its row."""
        device = batch.prompts.device
        prompts = [self.worker.context_prompts[row] for row in batch.prompt_rows.tolist()]
        ids, mask = left_pad(prompts, self.worker.pad_id, device)  # (B, P')
        width = max(1, max(len(a.teacher_ids) for a in alignments))
        responses = torch.full((len(batch), width), self.worker.pad_id, dtype=torch.long)  # (B, R')
        response_mask = torch.zeros((len(batch), width), dtype=batch.response_mask.dtype)
        for i, a in enumerate(alignments):
            responses[i, : len(a.teacher_ids)] = torch.tensor(a.teacher_ids, dtype=torch.long)
            response_mask[i, : len(a.teacher_ids)] = 1
        return assemble(ids, mask, responses.to(device), response_mask.to(device), None, batch.prompt_rows)

    @torch.no_grad()
    def compute_teacher_log_prob(self, batch: Batch, rows_per_forward: int) -> Batch:
        """Fills student_span (B, R), teacher_span_logprobs (B, S), teacher_logprobs (B, R) (the
        spans' log-probs credited to their student tokens), teacher_text_logprobs and response_chars (B,);
        with a floor for the bytes the teacher cannot write, response_bytes and unwritable_bytes (B,)."""
        alignments = self.align(batch)
        theirs = self.teacher_batch(batch, alignments)
        worker = self.worker
        worker.model.eval()
        with worker.scoring():
            parts = worker.score_rows(theirs, rows_per_forward)
        token_log_probs = torch.cat([p[0] for p in parts]) * theirs.response_mask  # (B, R') in the teacher's tokens
        spans = max(1, max(a.num_spans for a in alignments))
        student_span = torch.full_like(batch.responses, -1)  # (B, R)
        teacher_span = torch.full_like(theirs.responses, -1)  # (B, R')
        aligned = torch.zeros((len(batch), spans), dtype=torch.bool)  # (B, S)
        # (B, S) bytes the teacher cannot write
        hole_bytes = torch.zeros((len(batch), spans), dtype=token_log_probs.dtype, device=token_log_probs.device)
        for i, a in enumerate(alignments):
            student_span[i, : len(a.student_span)] = torch.tensor(a.student_span)
            teacher_span[i, : len(a.teacher_span)] = torch.tensor(a.teacher_span)
            aligned[i, : a.num_spans] = torch.tensor(a.aligned, dtype=torch.bool)
            hole_bytes[i, : a.num_spans] = torch.tensor(a.hole_bytes, dtype=hole_bytes.dtype)
        span_log_probs = span_sums(token_log_probs, teacher_span, spans)  # (B, S)
        if self.unwritable_byte_log_prob is not None:  # those bytes at the floor, each (finite: the config checks)
            span_log_probs = span_log_probs + self.unwritable_byte_log_prob * hole_bytes
            batch.response_bytes = torch.tensor([a.text_bytes for a in alignments], device=batch.prompts.device)
            batch.unwritable_bytes = torch.tensor([a.floored_bytes for a in alignments], device=batch.prompts.device)
        batch.student_span = student_span
        batch.teacher_span_logprobs = span_log_probs * aligned.to(span_log_probs.device)
        batch.teacher_logprobs = credit_to_tokens(batch.teacher_span_logprobs, student_span, self.credit)
        batch.teacher_text_logprobs = token_log_probs.sum(-1)  # (B,)
        batch.response_chars = torch.tensor([len(a.text) for a in alignments], device=batch.prompts.device)
        return batch
