"""Teacher role (verl: `compute_teacher_log_prob`): the frozen teacher scores the sampled tokens.

One forward over prompt + response per chunk of rows. It always returns the log-prob of the
token the student sampled (`teacher_logprobs`); for `forward_kl_topk` also its own top-k
log-probs and their token ids at every position.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager as ContextManager
from contextlib import ExitStack, nullcontext

import torch
from transformers import PreTrainedModel

from miniverl.models import cpu_gemm
from miniverl.protocol import Batch
from miniverl.workers.logprobs import response_log_probs, response_log_probs_and_topk


class TeacherWorker:
    def __init__(
        self,
        model: PreTrainedModel,
        *,
        logprob_chunk: int,
        topk: int | None,
        context: Callable[[], ContextManager] = nullcontext,
        tokenizer_vocab: int | None = None,
        float32_gemm: bool = False,
    ):
        """`model` is the teacher; in the ref and shared_base modes it is the student's own base
        model, and `context` switches its adapters for the teacher's forward."""
        self.model = model
        self.context = context
        self.logprob_chunk = logprob_chunk
        self.topk = topk  # None: only the sampled token is needed
        self.tokenizer_vocab = tokenizer_vocab  # output rows past it are padding: never scored
        self.float32_gemm = float32_gemm  # CPU only: see cpu_gemm

    def scoring(self) -> ContextManager:
        """The teacher's forward setting: its adapters (ref, shared_base) and its CPU products."""
        stack = ExitStack()
        stack.enter_context(self.context())
        stack.enter_context(cpu_gemm.float32_products(self.model, self.float32_gemm))
        return stack

    @torch.no_grad()  # not inference_mode: the actor's autograd graph reads these tensors
    def compute_teacher_log_prob(self, batch: Batch, rows_per_forward: int) -> Batch:
        """Fills teacher_logprobs (B, R) [and teacher_topk_logprobs, teacher_ids (B, R, k)], at
        temperature 1 (verl requires 1.0 for the teacher)."""
        self.model.eval()
        with self.scoring():
            parts = self._score(batch, rows_per_forward)
        columns = [torch.cat(c) for c in zip(*parts)]
        batch.teacher_logprobs = columns[0] * batch.response_mask
        if self.topk is not None:
            batch.teacher_topk_logprobs, batch.teacher_ids = columns[1], columns[2]
        return batch

    def _score(self, batch: Batch, rows_per_forward: int) -> list[tuple[torch.Tensor, ...]]:
        parts = []
        for start in range(0, len(batch), rows_per_forward):
            rows = batch.rows(start, start + rows_per_forward)
            if self.topk is None:
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
