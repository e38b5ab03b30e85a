"""What the roles need from a causal LM at the response positions, without a float32
(B, T, V) log-softmax.

The decoder runs once; its hidden states are turned into logits a chunk of positions at a time,
and each chunk keeps only what its caller asks for (the sampled token's log-prob, the teacher's
top-k, the top-k KL terms). A chunk holds at most `chunk` positions and at most
`MAX_CHUNK_ELEMENTS` logits, so the memory of a chunk is bounded for any vocabulary size.

Sampled-token log-probs, log p(y) = z_y - logsumexp(z) with z = lm_head(h) / tau (tau: the temperature):

- without gradients: per chunk one float32 logits block, reduced in place (max, exp, sum) after
  the sampled logit is gathered;
- with gradients, when the lm_head is a frozen plain Linear (LoRA and every frozen-head setup):
  the gradient with respect to h is formed in the forward pass, d log p(y) / dh =
  (W_y - softmax(z) W) / tau, one (N, H) tensor, so the backward never recomputes or keeps logits
  (two lm_head-sized matmuls per chunk in all, as a plain forward + backward has);
- otherwise (a trainable head, other outputs): each chunk is recomputed in backward (activation
  checkpointing), so autograd never holds more than one chunk's logits either.

Padding rows. An output layer may have more rows than the tokenizer has ids (Qwen3: 151,936 rows
for 151,669 tokens). `tokenizer_vocab` (len(tokenizer)) cuts every distribution to the real ids:
the rollout samples from it and the teacher and the actor score with it, so all three use one
and the same distribution, and no role ever yields an id the tokenizer cannot decode. None: all
rows.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils.checkpoint import checkpoint
from transformers import PreTrainedModel

from miniverl.models.loading import decoder_of
from miniverl.protocol import Batch
from miniverl.workers.topk_loss import TopkTerms, forward_kl_topk_terms

MAX_CHUNK_ELEMENTS = 1 << 24  # logits per chunk at most (64 MiB in float32), whatever `chunk` says
# Shifted logits (z - max z) are clamped from below here before exp(): exp(-80) ~ 1.8e-35 is still a
# normal float, exp of anything below ~-87.3 is subnormal, and x86 CPUs compute with subnormals many
# times slower (measured, 2-core Xeon: exp over (4, 49152) logits spread like a confident model's
# 2.0 ms against 0.03 ms, every pass after it 10x; a log-sum-exp over (256, 49152) 147 ms against
# 9 ms). The values do not move: the largest term is exp(0) = 1, so a sum is >= 1 and V * 1.8e-35
# is far below half its ulp; a probability below 2^-52 is 0 in the sampler's fixed point either way.
EXP_FLOOR = -80.0


def rows_per_chunk(chunk: int, vocab: int) -> int:
    """Positions per chunk: `chunk`, fewer if chunk x vocab logits would pass MAX_CHUNK_ELEMENTS."""
    return max(1, min(chunk, MAX_CHUNK_ELEMENTS // max(1, vocab)))


def map_position_chunks(
    fn: Callable[..., tuple[torch.Tensor, ...]], hidden: torch.Tensor, *per_position: torch.Tensor, chunk: int
) -> tuple[torch.Tensor, ...]:
    """Apply fn(hidden (N, H), *args (N, ...)) -> tensors (N, ...) over chunks of the B*T positions
    of hidden (B, T, H); returns each output reshaped to (B, T, ...)."""
    B, T = hidden.shape[:2]
    flat_h = hidden.reshape(B * T, hidden.shape[-1])
    flat_args = [a.reshape(B * T, *a.shape[2:]) for a in per_position]
    grad = torch.is_grad_enabled() and flat_h.requires_grad
    outputs = []
    for start in range(0, max(B * T, 1), chunk):  # no positions (token selection kept none): fn of empty ones
        args = (flat_h[start : start + chunk], *(a[start : start + chunk] for a in flat_args))
        outputs.append(checkpoint(fn, *args, use_reentrant=False) if grad else fn(*args))
    return tuple(torch.cat(parts).reshape(B, T, *parts[0].shape[1:]) for parts in zip(*outputs))


def token_logits(
    lm_head: torch.nn.Module, hidden: torch.Tensor, tokenizer_vocab: int | None, temperature: float = 1.0
) -> torch.Tensor:
    """(N, V) logits over the tokenizer's ids (padding rows cut), divided by the temperature: float32,
    or float64 from a float64 head (the exactness tests)."""
    logits = lm_head(hidden)[..., :tokenizer_vocab]  # (N, V)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return logits / temperature if temperature != 1.0 else logits


def _sampled(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return logits.gather(-1, tokens[:, None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)  # (N,)


def _sampled_in_place(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """_sampled without a second (N, V) buffer: overwrites `logits` (no autograd)."""
    picked = logits.gather(-1, tokens[:, None]).squeeze(-1)  # (N,)
    top = logits.amax(-1, keepdim=True)  # (N, 1)
    log_z = logits.sub_(top).clamp_(min=EXP_FLOOR).exp_().sum(-1).log_() + top.squeeze(-1)
    return picked - log_z


def frozen_linear_head(lm_head: torch.nn.Module) -> bool:
    """A plain Linear whose weight (and bias) are not trained: the fused-gradient path applies."""
    return (
        type(lm_head) is torch.nn.Linear
        and not lm_head.weight.requires_grad
        and (lm_head.bias is None or not lm_head.bias.requires_grad)
    )


class _SampledLogProbFrozenHead(torch.autograd.Function):
    """log p(token) from hidden states through a frozen linear head; d/dh is formed in forward."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, tokens, temperature, rows):  # weight (V, H): padding rows cut
        dtype = log_prob_dtype(weight)
        out = torch.empty(hidden.shape[0], dtype=dtype, device=hidden.device)
        grad = torch.empty(hidden.shape, dtype=dtype, device=hidden.device)  # (N, H)
        for start in range(0, hidden.shape[0], rows):
            h, tok = hidden[start : start + rows], tokens[start : start + rows]
            logits = torch.nn.functional.linear(h, weight, bias).to(dtype)  # (n, V)
            if temperature != 1.0:
                logits = logits / temperature
            picked = logits.gather(-1, tok[:, None]).squeeze(-1)
            top = logits.amax(-1, keepdim=True)
            probs = logits.sub_(top).clamp_(min=EXP_FLOOR).exp_()  # in place: one (n, V) buffer per chunk
            total = probs.sum(-1, keepdim=True)
            out[start : start + rows] = picked - (total.log() + top).squeeze(-1)  # z_y - logsumexp(z)
            # softmax - onehot; its product with W is -(W_y - p W).
            probs.div_(total).scatter_add_(-1, tok[:, None], torch.full_like(total, -1.0))
            grad[start : start + rows] = (probs.to(weight.dtype) @ weight).to(dtype).neg_()
        if temperature != 1.0:
            grad.div_(temperature)
        ctx.save_for_backward(grad)
        ctx.hidden_dtype = hidden.dtype
        return out

    @staticmethod
    def backward(ctx, grad_out):
        (grad,) = ctx.saved_tensors
        return (grad * grad_out[:, None]).to(ctx.hidden_dtype), None, None, None, None, None


def log_prob_dtype(weight: torch.Tensor) -> torch.dtype:
    """float32, or float64 from a float64 head (as `token_logits`: the exactness tests)."""
    return torch.promote_types(weight.dtype, torch.float32) if weight.is_floating_point() else torch.float32


def output_rows(lm_head: torch.nn.Module, tokenizer_vocab: int | None) -> int:
    rows = lm_head.weight.shape[0]
    return rows if tokenizer_vocab is None else min(rows, tokenizer_vocab)


def sampled_log_probs(
    lm_head: torch.nn.Module,
    hidden: torch.Tensor,
    tokens: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk: int = 256,
    tokenizer_vocab: int | None = None,
) -> torch.Tensor:
    """log p(tokens) for hidden (B, T, H) and tokens (B, T): (B, T) float32 (float64 from a float64
    head), never holding more than one chunk of logits (forward or backward)."""
    B, T = tokens.shape
    vocab = output_rows(lm_head, tokenizer_vocab)
    rows = rows_per_chunk(chunk, vocab)
    grad = torch.is_grad_enabled() and hidden.requires_grad
    flat_h, flat_t = hidden.reshape(B * T, hidden.shape[-1]), tokens.reshape(B * T)
    if grad and frozen_linear_head(lm_head):
        bias = None if lm_head.bias is None else lm_head.bias[:vocab]
        out = _SampledLogProbFrozenHead.apply(flat_h, lm_head.weight[:vocab], bias, flat_t, temperature, rows)
        return out.reshape(B, T)
    if grad:

        def fn(h, tok):
            return (_sampled(token_logits(lm_head, h, tokenizer_vocab, temperature), tok),)

        return map_position_chunks(fn, hidden, tokens, chunk=rows)[0]
    out = torch.empty(B * T, dtype=log_prob_dtype(lm_head.weight), device=hidden.device)
    for start in range(0, B * T, rows):
        logits = token_logits(lm_head, flat_h[start : start + rows], tokenizer_vocab, temperature)
        out[start : start + rows] = _sampled_in_place(logits, flat_t[start : start + rows])
    return out.reshape(B, T)


def response_hidden_states(model: PreTrainedModel, batch: Batch) -> torch.Tensor:
    """Decoder hidden states at the positions that predict response tokens: (B, R, H).

    Sequence position p predicts token p + 1, so response token t (at position P + t) is
    predicted by position P + t - 1.
    """
    out = decoder_of(model)(
        input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids, use_cache=False
    )
    start = batch.prompt_length - 1
    # Contiguous: on the CPU a bf16 output layer multiplies a strided (B, R, H) slice 8-20x slower
    # than the same values in one block (the held-out probe's full log-probs; the same bits either
    # way), and every other caller copied the slice when it flattened it anyway.
    return out.last_hidden_state[:, start : start + batch.response_length].contiguous()


def full_log_probs(model: PreTrainedModel, batch: Batch, tokenizer_vocab: int | None) -> torch.Tensor:
    """(B, R, V) float32 next-token log-probs over the tokenizer's ids at the response positions
    (small vocabularies only: the held-out exact KL)."""
    hidden = response_hidden_states(model, batch)
    return token_logits(model.get_output_embeddings(), hidden, tokenizer_vocab).log_softmax(-1)


def response_log_probs(
    model: PreTrainedModel,
    batch: Batch,
    *,
    temperature: float = 1.0,
    chunk: int = 256,
    tokenizer_vocab: int | None = None,
) -> torch.Tensor:
    """log p(response token t | prompt, response_<t) for every row: (B, R) float32."""
    return sampled_log_probs(
        model.get_output_embeddings(),
        response_hidden_states(model, batch),
        batch.responses,
        temperature=temperature,
        chunk=chunk,
        tokenizer_vocab=tokenizer_vocab,
    )


def response_log_probs_and_topk(
    model: PreTrainedModel, batch: Batch, *, k: int, chunk: int = 256, tokenizer_vocab: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sampled-token log-probs (B, R) and the top-k log-probs (B, R, k) with their ids (B, R, k)."""
    lm_head = model.get_output_embeddings()

    def fn(h, tokens):
        logits = token_logits(lm_head, h, tokenizer_vocab)  # (N, V): one chunk at a time
        log_z = torch.logsumexp(logits, dim=-1, keepdim=True)
        top = logits.topk(k, dim=-1)
        return logits.gather(-1, tokens[:, None]).squeeze(-1) - log_z.squeeze(-1), top.values - log_z, top.indices

    rows = rows_per_chunk(chunk, output_rows(lm_head, tokenizer_vocab))
    return map_position_chunks(fn, response_hidden_states(model, batch), batch.responses, chunk=rows)


def topk_terms(
    lm_head: torch.nn.Module,
    hidden: torch.Tensor,
    tokens: torch.Tensor,
    teacher_ids: torch.Tensor,
    teacher_topk_logprobs: torch.Tensor,
    *,
    temperature: float,
    log_prob_min_clamp,
    chunk: int = 256,
    tokenizer_vocab: int | None = None,
) -> tuple[torch.Tensor, TopkTerms]:
    """The student's sampled-token log-probs (B, T) and the top-k forward-KL terms, each (B, T), from
    hidden states (B, T, H), tokens (B, T) and the teacher's top-k (B, T, k): any positions (token
    selection passes only the kept ones, as (N, 1, ...))."""

    def fn(h, tok, ids, t_lp):
        logits = token_logits(lm_head, h, tokenizer_vocab, temperature)
        terms = forward_kl_topk_terms(logits, t_lp, ids, log_prob_min_clamp=log_prob_min_clamp)
        return (_sampled(logits, tok), *terms)

    rows = rows_per_chunk(chunk, output_rows(lm_head, tokenizer_vocab))
    log_prob, *terms = map_position_chunks(fn, hidden, tokens, teacher_ids, teacher_topk_logprobs, chunk=rows)
    return log_prob, TopkTerms(*terms)


@torch.no_grad()
def entropy_and_log_probs(
    lm_head: torch.nn.Module,
    hidden: torch.Tensor,
    tokens: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk: int = 256,
    tokenizer_vocab: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The sampled tokens' log-probs and the entropies H = -sum_v q_v log q_v of the next-token
    distributions q (at `temperature`, over the tokenizer's ids), for hidden (B, T, H) and tokens
    (B, T): each (B, T) float32 (float64 from a float64 head), without gradients, one chunk of
    logits at a time.

    The log-probs are formed as `sampled_log_probs` forms them without gradients (the same
    operations in the same order: the same bits). With z' = z - max z (floored at EXP_FLOOR),
    e = exp(z') and Z = sum e: H = log Z - sum e z' / Z = log Z + sum entr(e) / Z, entr(e) = -e log e,
    all in the one (n, V) logits buffer."""
    B, T = tokens.shape
    rows = rows_per_chunk(chunk, output_rows(lm_head, tokenizer_vocab))
    flat_h, flat_t = hidden.reshape(B * T, hidden.shape[-1]), tokens.reshape(B * T)
    dtype = log_prob_dtype(lm_head.weight)
    log_prob = torch.empty(B * T, dtype=dtype, device=hidden.device)
    entropy = torch.empty(B * T, dtype=dtype, device=hidden.device)
    for start in range(0, B * T, rows):
        logits = token_logits(lm_head, flat_h[start : start + rows], tokenizer_vocab)  # (n, V)
        if temperature != 1.0:
            logits.div_(temperature)  # token_logits' division, in place: one (n, V) buffer in all
        picked = logits.gather(-1, flat_t[start : start + rows, None]).squeeze(-1)  # (n,)
        top = logits.amax(-1, keepdim=True)  # (n, 1)
        weights = logits.sub_(top).clamp_(min=EXP_FLOOR).exp_()  # in place: e = exp(z')
        total = weights.sum(-1)  # (n,) Z
        log_total = total.log()
        log_prob[start : start + rows] = picked - (log_total + top.squeeze(-1))
        entropy[start : start + rows] = log_total + torch.special.entr(weights, out=weights).sum(-1) / total
    return log_prob.reshape(B, T), entropy.reshape(B, T)


def response_entropy_and_log_probs(
    model: PreTrainedModel,
    batch: Batch,
    *,
    temperature: float = 1.0,
    chunk: int = 256,
    tokenizer_vocab: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`entropy_and_log_probs` at the response positions of every row: (log-probs, entropies), (B, R) each."""
    with torch.no_grad():
        return entropy_and_log_probs(
            model.get_output_embeddings(),
            response_hidden_states(model, batch),
            batch.responses,
            temperature=temperature,
            chunk=chunk,
            tokenizer_vocab=tokenizer_vocab,
        )
