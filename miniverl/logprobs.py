"""Log-probabilities of given tokens under a causal LM, without a float32 (B, T, V) log-softmax.

The decoder runs once; its hidden states are turned into logits a chunk of positions at a time,
and each chunk keeps only log p(token) = logit[token] - logsumexp(logits). With gradients on,
each chunk is recomputed in backward (activation checkpointing), so autograd never holds more
than one chunk's logits either.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint
from transformers import PreTrainedModel

from miniverl.batch import Batch


def _chunk_log_probs(hidden: torch.Tensor, tokens: torch.Tensor, lm_head: torch.nn.Module,
                     temperature: float) -> torch.Tensor:
    logits = lm_head(hidden).float()  # (N, V)
    if temperature != 1.0:
        logits = logits / temperature
    return logits.gather(-1, tokens[:, None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)  # (N,)


def token_log_probs(hidden: torch.Tensor, tokens: torch.Tensor, lm_head: torch.nn.Module, *,
                    temperature: float = 1.0, chunk: int = 256) -> torch.Tensor:
    """hidden (B, T, H), tokens (B, T) -> log p(tokens) (B, T) float32."""
    flat_h = hidden.reshape(-1, hidden.shape[-1])  # (B*T, H)
    flat_t = tokens.reshape(-1)
    grad = torch.is_grad_enabled() and flat_h.requires_grad
    out = []
    for start in range(0, flat_h.shape[0], chunk):
        args = (flat_h[start:start + chunk], flat_t[start:start + chunk], lm_head, temperature)
        out.append(checkpoint(_chunk_log_probs, *args, use_reentrant=False) if grad else _chunk_log_probs(*args))
    return torch.cat(out).view(tokens.shape)


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
    hidden = response_hidden_states(model, batch)
    return token_log_probs(hidden, batch.responses, model.get_output_embeddings(),
                           temperature=temperature, chunk=chunk)
