"""What the roles need from a causal LM at the response positions, without a float32
(B, T, V) log-softmax.

The decoder runs once; its hidden states are turned into logits a chunk of positions at a time,
and each chunk keeps only what its caller asks for (the sampled token's log-prob, the teacher's
top-k, the top-k KL terms). With gradients on, each chunk is recomputed in backward (activation
checkpointing), so autograd never holds more than one chunk's logits either.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch.utils.checkpoint import checkpoint
from transformers import PreTrainedModel

from miniverl.batch import Batch
from miniverl.losses import TopkTerms, forward_kl_topk_terms


def map_position_chunks(fn: Callable[..., tuple[torch.Tensor, ...]], hidden: torch.Tensor,
                        *per_position: torch.Tensor, chunk: int) -> tuple[torch.Tensor, ...]:
    """Apply fn(hidden (N, H), *args (N, ...)) -> tensors (N, ...) over chunks of the B*T positions
    of hidden (B, T, H); returns each output reshaped to (B, T, ...)."""
    B, T = hidden.shape[:2]
    flat_h = hidden.reshape(B * T, -1)
    flat_args = [a.reshape(B * T, *a.shape[2:]) for a in per_position]
    grad = torch.is_grad_enabled() and flat_h.requires_grad
    outputs = []
    for start in range(0, B * T, chunk):
        args = (flat_h[start:start + chunk], *(a[start:start + chunk] for a in flat_args))
        outputs.append(checkpoint(fn, *args, use_reentrant=False) if grad else fn(*args))
    return tuple(torch.cat(parts).reshape(B, T, *parts[0].shape[1:]) for parts in zip(*outputs))


def _logits(lm_head: torch.nn.Module, hidden: torch.Tensor, temperature: float) -> torch.Tensor:
    logits = lm_head(hidden).float()  # (N, V)
    return logits / temperature if temperature != 1.0 else logits


def _sampled(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return logits.gather(-1, tokens[:, None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)  # (N,)


def response_hidden_states(model: PreTrainedModel, batch: Batch) -> torch.Tensor:
    """Decoder hidden states at the positions that predict response tokens: (B, R, H).

    Sequence position p predicts token p + 1, so response token t (at position P + t) is
    predicted by position P + t - 1.
    """
    out = model.get_decoder()(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                              position_ids=batch.position_ids, use_cache=False)
    start = batch.prompt_length - 1
    return out.last_hidden_state[:, start:start + batch.response_length]


def response_log_probs(model: PreTrainedModel, batch: Batch, *, temperature: float = 1.0,
                       chunk: int = 256) -> torch.Tensor:
    """log p(response token t | prompt, response_<t) for every row: (B, R) float32."""
    lm_head = model.get_output_embeddings()

    def fn(h, tokens):
        return (_sampled(_logits(lm_head, h, temperature), tokens),)

    return map_position_chunks(fn, response_hidden_states(model, batch), batch.responses, chunk=chunk)[0]


def response_log_probs_and_topk(model: PreTrainedModel, batch: Batch, *, k: int,
                                chunk: int = 256) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sampled-token log-probs (B, R) and the top-k log-probs (B, R, k) with their ids (B, R, k)."""
    lm_head = model.get_output_embeddings()

    def fn(h, tokens):
        log_probs = _logits(lm_head, h, 1.0).log_softmax(-1)  # (N, V): one chunk at a time
        top = log_probs.topk(k, dim=-1)
        return log_probs.gather(-1, tokens[:, None]).squeeze(-1), top.values, top.indices

    return map_position_chunks(fn, response_hidden_states(model, batch), batch.responses, chunk=chunk)


def response_topk_terms(model: PreTrainedModel, batch: Batch, teacher_ids: torch.Tensor,
                        teacher_topk_logprobs: torch.Tensor, *, temperature: float, log_prob_min_clamp,
                        chunk: int = 256) -> tuple[torch.Tensor, TopkTerms]:
    """The student's sampled-token log-probs (B, R) and the top-k forward-KL terms, each (B, R)."""
    lm_head = model.get_output_embeddings()

    def fn(h, tokens, ids, t_lp):
        logits = _logits(lm_head, h, temperature)
        terms = forward_kl_topk_terms(logits, t_lp, ids, log_prob_min_clamp=log_prob_min_clamp)
        return (_sampled(logits, tokens), *terms)

    log_prob, *terms = map_position_chunks(fn, response_hidden_states(model, batch), batch.responses,
                                           teacher_ids, teacher_topk_logprobs, chunk=chunk)
    return log_prob, TopkTerms(*terms)
