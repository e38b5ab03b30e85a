"""The exact reverse KL(student || teacher) over the whole vocabulary at every response position
(`estimator=reverse_kl_full`): miniverl's own loss, not verl's (verl RFC #7239 asks for one).

    KL_t = sum_v pi(v | x, y_<t) (log pi(v | x, y_<t) - log nu(v | x, y_<t))

backpropagated directly (no policy gradient): its gradient with respect to the student's logits z
at position t is pi (log pi - log nu - KL_t) / T, the whole distribution's, where a sampled-token
estimator sees one token. TRL's `DistillationTrainer` with beta=1 trains with the same loss.

Memory. The teacher returns its final hidden states at the response positions (B, R, H), not
its log-probs (B, R, V): the logits of both models are formed here a chunk of positions at a time
through each model's own output layer, and each chunk is recomputed in the backward pass
(`map_position_chunks`), so no more than one chunk's (n, V) blocks are ever held.

The student's logits are divided by the rollout temperature, the teacher's are not (the teacher
scores at temperature 1 in every miniverl and verl estimator; TRL divides both).

Shapes: B rows, T padded response positions, H hidden size, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from miniverl.workers.logprobs import map_position_chunks, output_rows, rows_per_chunk, token_logits
from miniverl.workers.losses import Number, finish_loss


def reverse_kl_full_terms(
    student_head: torch.nn.Module,
    student_hidden: torch.Tensor,  # (B, T, H) with the gradient
    tokens: torch.Tensor,  # (B, T) the sampled tokens
    teacher_heads: Sequence[torch.nn.Module],  # each teacher's output layer (frozen)
    teacher_hidden: torch.Tensor,  # (B, T, H_t) the teacher's final hidden states
    teacher_index: torch.Tensor | None,  # (B,) which head scores each row; None: the first
    *,
    temperature: float = 1.0,
    chunk: int = 256,
    tokenizer_vocab: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log pi(y_t), KL_t), each (B, T) float32 with the student's graph."""
    B, T = tokens.shape
    index = torch.zeros(B, dtype=torch.long, device=tokens.device) if teacher_index is None else teacher_index
    per_position_index = index[:, None].expand(B, T)  # (B, T)

    def fn(h, tok, h_teacher, which):
        logits = token_logits(student_head, h, tokenizer_vocab, temperature)  # (n, V) float32
        # log Z as the no-gradient pass forms it (max, exp, sum), so the sampled token's log-prob
        # has the same bits as compute_log_prob's: the update's forward stays the old log-probs.
        top = logits.amax(-1, keepdim=True).detach()  # (n, 1)
        student = logits - ((logits - top).exp().sum(-1, keepdim=True).log() + top)  # (n, V) log pi
        with torch.no_grad():
            teacher = torch.empty_like(student)  # (n, V) log nu, each position by its own teacher
            for i, head in enumerate(teacher_heads):
                rows = which == i
                if rows.any():
                    h_i = h_teacher[rows][:, : head.weight.shape[1]].to(head.weight.dtype)  # its own width
                    teacher[rows] = token_logits(head, h_i, tokenizer_vocab).log_softmax(-1)
        kl = (student.exp() * (student - teacher)).sum(-1)  # (n,)
        return student.gather(-1, tok[:, None]).squeeze(-1), kl

    vocab = output_rows(student_head, tokenizer_vocab)
    return map_position_chunks(
        fn, student_hidden, tokens, teacher_hidden, per_position_index, chunk=rows_per_chunk(chunk, vocab)
    )


def reverse_kl_full(
    est: Any,
    kl: torch.Tensor,  # (B, T) KL_t with the student's graph
    response_mask: torch.Tensor,  # (B, T)
    *,
    batch_num_tokens: Number | None,
    global_batch_size: Number | None,
    loss_scale_factor: Number | None = None,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """(loss scalar, per-token loss (B, T), metrics), aggregated by estimator.loss_agg_mode as every
    estimator is; metrics: distillation/abs_loss (the mean exact KL over response tokens), loss_min,
    loss_max."""
    mask = response_mask.bool()
    with torch.no_grad():
        n = int(mask.sum())
        total = float(torch.where(mask, kl.abs(), torch.zeros((), dtype=kl.dtype, device=kl.device)).sum())
        metrics = {"distillation/abs_loss": total / n if n else 0.0}
    return finish_loss(
        est,
        kl,
        mask,
        metrics,
        log_prob=None,
        old_log_prob=None,
        batch_num_tokens=batch_num_tokens,
        global_batch_size=global_batch_size,
        loss_scale_factor=loss_scale_factor,
    )
