"""Teacher role (verl: `compute_teacher_log_prob`): the frozen teacher scores the sampled tokens.

One forward over prompt + response per chunk of rows. It always returns the log-prob of the
token the student sampled (`teacher_logprobs`); for `forward_kl_topk` also its own top-k
log-probs and their token ids at every position; for `reverse_kl_full` and `reverse_kl_topk` also its final hidden
states there (`teacher_hidden_states`), from which the actor forms the teacher's whole
distribution through `output_head` a chunk of positions at a time.

A teacher with a privileged context (`teacher.context`) scores the same response tokens after its
own prompt (`context_prompts`, by parquet row): the batch it runs on is the student's responses
after those prompts, and its columns, aligned on the response positions, go back to the batch.

Several teachers (`teachers.<name>`, verl's multi-teacher distillation): `TeacherRouter` gives
each teacher the samples the plan routed to it (`teacher_index`), in their batch order, and puts
the teachers' columns back at those rows, so the actor sees one batch as with one teacher.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from contextlib import AbstractContextManager as ContextManager
from contextlib import ExitStack, nullcontext

import torch
from transformers import PreTrainedModel

from miniverl.models import cpu_gemm
from miniverl.protocol import Batch, with_prompts
from miniverl.workers.logprobs import (
    full_log_probs,
    response_hidden_states,
    response_log_probs,
    response_log_probs_and_topk,
    sampled_log_probs,
)


class TeacherWorker:
    def __init__(
        self,
        model: PreTrainedModel,
        *,
        logprob_chunk: int,
        topk: int | None,
        full_vocab: bool = False,
        adapter_switch: Callable[[], ContextManager] = nullcontext,
        tokenizer_vocab: int | None = None,
        float32_gemm: bool = False,
        weight_bytes: int = 0,
        context_prompts: dict[int, list[int]] | None = None,
        pad_id: int = 0,
    ):
        """`model` is the teacher; in the ref and shared_base modes it is the student's own base
        model, and `adapter_switch` sets its adapters for the teacher's forward. `weight_bytes`: the
        memory this teacher adds (its model's weights; shared_base: its adapter; ref: none)."""
        self.model = model
        self.adapter_switch = adapter_switch
        self.logprob_chunk = logprob_chunk
        self.topk = topk  # None: only the sampled token is needed
        self.full_vocab = full_vocab  # reverse_kl_full, reverse_kl_topk: the hidden states too
        self.tokenizer_vocab = tokenizer_vocab  # output rows past it are padding: never scored
        self.float32_gemm = float32_gemm  # CPU only: see cpu_gemm
        self.weight_bytes = weight_bytes
        self.context_prompts = context_prompts  # parquet row -> the teacher's own prompt ids; None: the student's
        self.pad_id = pad_id

    def for_prompts(self, context_prompts: dict[int, list[int]] | None) -> TeacherWorker:
        """This teacher (the same model) with the contexts of other rows (the held-out prompts')."""
        other = copy.copy(self)
        other.context_prompts = context_prompts
        return other

    def teacher_view(self, batch: Batch) -> Batch:
        """What the teacher scores: the batch itself, or its responses after the teacher's prompts."""
        if self.context_prompts is None:
            return batch
        prompts = [self.context_prompts[row] for row in batch.prompt_rows.tolist()]
        return with_prompts(batch, prompts, self.pad_id)

    def scoring(self) -> ContextManager:
        """The teacher's forward setting: its adapters (ref, shared_base) and its CPU products."""
        stack = ExitStack()
        stack.enter_context(self.adapter_switch())
        stack.enter_context(cpu_gemm.float32_products(self.model, self.float32_gemm))
        return stack

    @torch.no_grad()  # not inference_mode: the actor's autograd graph reads these tensors
    def compute_teacher_log_prob(self, batch: Batch, rows_per_forward: int) -> Batch:
        """Fills teacher_logprobs (B, R) [and teacher_topk_logprobs, teacher_ids (B, R, k)] [or
        teacher_hidden_states (B, R, H)], at temperature 1 (verl requires 1.0 for the teacher)."""
        self.model.eval()
        with self.scoring():
            parts = self.score_rows(self.teacher_view(batch), rows_per_forward)
        columns = [torch.cat(c) for c in zip(*parts)]
        batch.teacher_logprobs = columns[0] * batch.response_mask
        if self.topk is not None:
            batch.teacher_topk_logprobs, batch.teacher_ids = columns[1], columns[2]
        if self.full_vocab:
            batch.teacher_hidden_states = columns[1]
        return batch

    @property
    def output_head(self) -> torch.nn.Module:
        """The teacher's output layer (frozen; in the ref and shared_base modes the student's own)."""
        return self.model.get_output_embeddings()

    @torch.no_grad()
    def compute_full_log_probs(self, batch: Batch) -> torch.Tensor:
        """(B, R, V) the teacher's next-token log-probs over the tokenizer's ids (the held-out exact KL)."""
        self.model.eval()
        with self.scoring():
            return full_log_probs(self.model, self.teacher_view(batch), self.tokenizer_vocab)

    def score_rows(self, batch: Batch, rows_per_forward: int) -> list[tuple[torch.Tensor, ...]]:
        parts = []
        for start in range(0, len(batch), rows_per_forward):
            rows = batch.rows(start, start + rows_per_forward)
            if self.full_vocab:
                hidden = response_hidden_states(self.model, rows)  # (b, R, H)
                log_prob = sampled_log_probs(
                    self.output_head,
                    hidden,
                    rows.responses,
                    chunk=self.logprob_chunk,
                    tokenizer_vocab=self.tokenizer_vocab,
                )
                parts.append((log_prob, hidden))
            elif self.topk is None:
                parts.append(
                    (
                        response_log_probs(
                            self.model, rows, chunk=self.logprob_chunk, tokenizer_vocab=self.tokenizer_vocab
                        ),
                    )
                )
            else:
                parts.append(
                    response_log_probs_and_topk(
                        self.model, rows, k=self.topk, chunk=self.logprob_chunk, tokenizer_vocab=self.tokenizer_vocab
                    )
                )
        return parts


TEACHER_COLUMNS = ("teacher_logprobs", "teacher_topk_logprobs", "teacher_ids", "teacher_hidden_states")


class TeacherRouter:
    """Several teachers behind the teacher role's interface, each scoring its own samples."""

    def __init__(self, workers: dict[str, TeacherWorker]):
        self.workers = workers
        self.names = list(workers)  # teacher_index i is the i-th name

    def for_prompts(self, context_prompts: dict[str, dict[int, list[int]]]) -> TeacherRouter:
        """The same teachers with the contexts of other rows, by teacher name (absent: none)."""
        return TeacherRouter({n: w.for_prompts(context_prompts.get(n)) for n, w in self.workers.items()})

    def route(self, batch: Batch, sample_teachers: list[str] | tuple[str, ...]) -> Batch:
        """Fills teacher_index (B,) from each sample's teacher name (the plan's sample_teachers)."""
        batch.teacher_index = torch.tensor(
            [self.names.index(name) for name in sample_teachers], dtype=torch.long, device=batch.prompts.device
        )
        return batch

    def _by_teacher(self, batch: Batch):
        for i, worker in enumerate(self.workers.values()):
            rows = (batch.teacher_index == i).nonzero(as_tuple=True)[0]  # (b,) this teacher's samples
            if len(rows):
                yield worker, rows

    def compute_teacher_log_prob(self, batch: Batch, rows_per_forward: int) -> Batch:
        """Every teacher on its samples, `rows_per_forward` rows at a time; the columns scattered back."""
        for worker, rows in self._by_teacher(batch):
            part = worker.compute_teacher_log_prob(batch.select(rows), rows_per_forward)
            for name in TEACHER_COLUMNS:
                if (scored := getattr(part, name)) is None:
                    continue
                column = getattr(batch, name)
                if name == "teacher_hidden_states" and column is not None:
                    # Teachers may differ in hidden size: the column is as wide as the widest, zero
                    # after a narrower teacher's own width (each head reads only its own).
                    column, scored = widest(column, scored)
                    setattr(batch, name, column)
                if column is None or column.shape[1:] != scored.shape[1:]:
                    column = scored.new_zeros((len(batch), *scored.shape[1:]))  # every row gets its teacher's
                    setattr(batch, name, column)
                column[rows] = scored
        return batch

    @torch.no_grad()
    def compute_full_log_probs(self, batch: Batch) -> torch.Tensor:
        out = None
        for worker, rows in self._by_teacher(batch):
            scored = worker.compute_full_log_probs(batch.select(rows))  # (b, R, V)
            if out is None:
                out = scored.new_zeros((len(batch), *scored.shape[1:]))
            out[rows] = scored
        return out


def widest(column: torch.Tensor, scored: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Both (…, H) tensors zero-padded on the last dimension to the wider H, in a common dtype."""
    dtype = torch.promote_types(column.dtype, scored.dtype)
    width = max(column.shape[-1], scored.shape[-1])
    pad = torch.nn.functional.pad
    return (
        pad(column.to(dtype), (0, width - column.shape[-1])),
        pad(scored.to(dtype), (0, width - scored.shape[-1])),
    )
