"""The exact reverse KL(student || teacher) over the whole vocabulary at every response position
(`estimator=reverse_kl_full`): miniverl's own loss, not verl's (verl RFC #7239 asks for one).

    KL_t = sum_v pi(v | x, y_<t) (log pi(v | x, y_<t) - log nu(v | x, y_<t))

backpropagated directly (no policy gradient): its gradient with respect to the student's logits z
at position t is pi (log pi - log nu - KL_t) / tau (tau: the temperature), the whole distribution's,
where a sampled-token estimator sees one token. TRL's `DistillationTrainer` with beta=1 trains with the same loss.

Memory. The teacher returns its final hidden states at the response positions (B, R, H), not
its log-probs (B, R, V): the logits of both models are formed here a chunk of positions at a time
through each model's own output layer, and each chunk is recomputed in the backward pass
(`map_position_chunks`), so no more than one chunk's (n, V) blocks are ever held.

The student's logits are divided by the rollout temperature, the teacher's are not (the teacher
scores at temperature 1 in every miniverl and verl estimator; TRL divides both).

The student's top-k (`estimator=reverse_kl_topk`, verl #7425 / #7590, not merged): the same sum over
the student's k most likely tokens S_t only (chosen by its logits at temperature, the choice not
differentiated), not renormalised, as #7590's truncated reverse KL:

    L_t = sum_{v in S_t} pi(v) (log pi(v) - log nu(v))

It can be negative (the k masses do not sum to 1) and is not floored; the gradient flows through pi
(weight and log, so through the whole log-normaliser) and not through nu. It is the full sum with the
terms outside S_t zeroed, so with k = V it is the full KL bit for bit, value and gradient.

Shapes: B rows, T padded response positions, H hidden size, V vocabulary, k the student's top-k.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from miniverl.config.estimator import EstimatorConfig
from miniverl.workers.logprobs import map_position_chunks, output_rows, rows_per_chunk, token_logits
from miniverl.workers.losses import Number, finish_loss, masked_range


class ReverseKLTopkTerms(NamedTuple):
    """Per-position terms of reverse_kl_topk, each (B, T)."""

    loss: torch.Tensor  # sum over the student's top-k of pi (log pi - log nu), with the student's graph
    student_mass: torch.Tensor  # sum over the student's top-k of pi (no graph)
    teacher_mass: torch.Tensor  # sum over the student's top-k of nu (no graph)


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
    topk: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | ReverseKLTopkTerms]:
    """(log pi(y_t), KL_t), each (B, T) float32 with the student's graph. With `topk` (reverse_kl_topk):
    (log pi(y_t), ReverseKLTopkTerms) over the student's min(topk, V) most likely tokens at each position."""
    if topk is not None and topk < 1:
        raise ValueError(f"topk={topk} must be a positive integer (or None: the full vocabulary)")
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
        log_prob = student.gather(-1, tok[:, None]).squeeze(-1)  # (n,)
        probs = student.exp()  # (n, V) pi
        terms = probs * (student - teacher)  # (n, V)
        if topk is None:
            return log_prob, terms.sum(-1)  # (n,) KL_t
        with torch.no_grad():  # S_t: the student's top-k at temperature, a choice not differentiated
            ids = logits.detach().topk(min(topk, logits.shape[-1]), dim=-1).indices  # (n, k)
            chosen = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device).scatter_(-1, ids, True)
            zero = torch.zeros((), dtype=student.dtype, device=student.device)
            student_mass = torch.where(chosen, probs, zero).sum(-1)  # (n,)
            teacher_mass = torch.where(chosen, teacher.exp(), zero).sum(-1)  # (n,)
        # The full sum's terms, those outside S_t zeroed (k = V: the full KL's bits).
        loss = torch.where(chosen, terms, torch.zeros((), dtype=terms.dtype, device=terms.device)).sum(-1)
        return log_prob, loss, student_mass, teacher_mass

    vocab = output_rows(student_head, tokenizer_vocab)
    log_prob, *rest = map_position_chunks(
        fn, student_hidden, tokens, teacher_hidden, per_position_index, chunk=rows_per_chunk(chunk, vocab)
    )
    return (log_prob, rest[0]) if topk is None else (log_prob, ReverseKLTopkTerms(*rest))


def reverse_kl_full(
    est: EstimatorConfig,
    per_position: torch.Tensor | ReverseKLTopkTerms,  # (B, T) KL_t with the student's graph; reverse_kl_topk's terms
    response_mask: torch.Tensor,  # (B, T)
    *,
    batch_num_tokens: Number | None,
    global_batch_size: Number | None,
    loss_scale_factor: Number | None = None,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """(loss scalar, per-token loss (B, T), metrics), aggregated by estimator.loss_agg_mode as every
    estimator is, after loss_max_clamp if set (finish_loss, as verl's distillation_loss); metrics:
    distillation/abs_loss (the mean |loss| over response tokens), loss_min, loss_max (before the
    clamp); reverse_kl_topk (per_position: the ReverseKLTopkTerms of reverse_kl_full_terms(..., topk=est.topk))
    also distillation/student_mass and teacher_mass (the mean mass of the student's top-k under each
    model, verl's top-k names) with their _min/_max. The top-k loss is not floored at 0."""
    is_topk = est.loss_mode == "reverse_kl_topk"
    if is_topk != isinstance(per_position, ReverseKLTopkTerms):
        raise ValueError(
            f"loss_mode={est.loss_mode} needs "
            + ("reverse_kl_full_terms(..., topk=est.topk)" if is_topk else "reverse_kl_full_terms(..., topk=None)")
        )
    terms = per_position if is_topk else None
    kl = per_position.loss if is_topk else per_position  # (B, T)
    mask = response_mask.bool()
    with torch.no_grad():
        n = int(mask.sum())
        total = float(torch.where(mask, kl.abs(), torch.zeros((), dtype=kl.dtype, device=kl.device)).sum())
        metrics = {"distillation/abs_loss": total / n if n else 0.0}
        if is_topk:
            for name, mass in (("student_mass", terms.student_mass), ("teacher_mass", terms.teacher_mass)):
                metrics[f"distillation/{name}"] = float(mass[mask].sum()) / n if n else 0.0
                metrics.update(masked_range(mass, mask, f"distillation/{name}"))
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


def exact_reverse_kl(student_log_probs: torch.Tensor, teacher_log_probs: torch.Tensor) -> torch.Tensor:
    """(B, T) KL(student || teacher) of two next-token distributions given whole, (B, T, V) log-probs each:
    sum_v pi(v) (log pi(v) - log nu(v)). The held-out probe's measure (no gradient, no chunks: small V)."""
    return (student_log_probs.exp() * (student_log_probs - teacher_log_probs)).sum(-1)
