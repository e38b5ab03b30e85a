"""exp() never meets a subnormal float (logprobs.EXP_FLOOR), and the numbers do not move: over logits
spread like a confident model's, where most of exp(z - max z) underflows, the sampler draws the same
tokens with the same log-probs, and the sampled-token log-probs (no grad, and the frozen-head
gradient path) equal those computed without the floor. The decoder's states at the response positions
come as one block."""

from __future__ import annotations

import torch

from miniverl.bench.loss_memory import small_qwen3
from miniverl.protocol import assemble
from miniverl.workers.logprobs import EXP_FLOOR, response_hidden_states, sampled_log_probs
from miniverl.workers.rollout.sampling import fixed_point_units, sample_token

SMALLEST_NORMAL = torch.finfo(torch.float32).tiny


def peaked_logits(rows: int, vocab: int, seed: int) -> torch.Tensor:
    """(rows, vocab) float32 logits with a spread of up to ~250 nats: most exp(z - max) are subnormal."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=generator) * torch.linspace(5.0, 60.0, rows)[:, None]
    logits[:, :3] += 40.0  # a few confident tokens
    shifted = logits - logits.amax(-1, keepdim=True)
    assert ((shifted.exp() > 0) & (shifted.exp() < SMALLEST_NORMAL)).any()  # the case at hand
    assert (shifted < EXP_FLOOR).float().mean() > 0.3
    return logits


def unfloored_sample(logits: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """sample_token's inverse-CDF draw (no top-k/top-p) with a plain exp()."""
    top = logits.amax(-1, keepdim=True)
    weights = (logits - top).exp()
    log_z = top.squeeze(-1) + weights.sum(-1).log()
    cdf = fixed_point_units(weights).cumsum(-1)
    x = torch.minimum((u[:, None] * cdf[:, -1:]).long(), cdf[:, -1:] - 1)
    token = torch.searchsorted(cdf, x, right=True).squeeze(-1)
    return token, logits.gather(-1, token[:, None]).squeeze(-1) - log_z


def test_the_sampler_draws_and_scores_as_without_the_exp_floor():
    for seed in range(20):
        logits = peaked_logits(8, 4099, seed)
        u = torch.rand(8, generator=torch.Generator().manual_seed(100 + seed), dtype=torch.float64)
        token, log_prob = sample_token(logits.clone(), u)
        expected_token, expected_log_prob = unfloored_sample(logits, u)
        assert torch.equal(token, expected_token)
        assert torch.equal(log_prob, expected_log_prob)


def test_sampled_log_probs_and_their_gradient_are_those_without_the_exp_floor():
    vocab, hidden_size = 4099, 16
    head = torch.nn.Linear(hidden_size, vocab, bias=False).requires_grad_(False)  # frozen: the fused path
    # Integer weights and hidden states make every logit exact, so the check does not depend on how
    # the CPU's GEMM blocks a chunk of rows against the whole.
    with torch.no_grad():
        head.weight.copy_((torch.randn(vocab, hidden_size, generator=torch.Generator().manual_seed(1)) * 4.0).round())
    hidden = (torch.randn(2, 5, hidden_size, generator=torch.Generator().manual_seed(2)) * 3.0).round()
    tokens = torch.randint(0, vocab, (2, 5), generator=torch.Generator().manual_seed(3))
    peaked_logits_of_hidden = head(hidden).reshape(10, vocab)
    shifted = peaked_logits_of_hidden - peaked_logits_of_hidden.amax(-1, keepdim=True)
    assert (shifted < EXP_FLOOR).float().mean() > 0.3  # most of the row would underflow

    # The same log-sum-exp with a plain exp(): torch.log_softmax sums in its own order, which
    # matches ours on AVX-512 kernels but not on AVX2 ones, so it is checked to rounding below.
    logits = head(hidden)  # (B, T, V)
    top = logits.amax(-1)  # (B, T)
    unfloored = logits.gather(-1, tokens[..., None]).squeeze(-1) - ((logits - top[..., None]).exp().sum(-1).log() + top)
    with torch.no_grad():
        floored = sampled_log_probs(head, hidden, tokens, chunk=4)
    assert torch.equal(floored, unfloored)
    torch.testing.assert_close(floored, torch.log_softmax(logits, -1).gather(-1, tokens[..., None]).squeeze(-1))

    leaf = hidden.clone().requires_grad_(True)
    sampled_log_probs(head, leaf, tokens, chunk=4).sum().backward()
    reference = hidden.clone().requires_grad_(True)
    torch.log_softmax(head(reference), -1).gather(-1, tokens[..., None]).sum().backward()
    torch.testing.assert_close(leaf.grad, reference.grad, rtol=1e-5, atol=1e-6)


def test_the_response_hidden_states_are_one_block_the_output_layer_multiplies_fast():
    """On the CPU a bf16 output layer multiplied a strided slice of the decoder's states 8-20x slower
    than the same values in one block: the held-out probe's full log-probs paid it at every evaluation."""
    model = small_qwen3(vocab=61, hidden=32, layers=1, seed=0).to(torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    prompts, responses = torch.randint(1, 61, (2, 5), generator=g), torch.randint(1, 61, (2, 3), generator=g)
    prompt_mask = torch.ones(2, 5, dtype=torch.long)  # no padding
    batch = assemble(prompts, prompt_mask, responses, torch.ones(2, 3), torch.zeros(2, 3), [0, 1])
    with torch.no_grad():
        hidden = response_hidden_states(model, batch)  # (B, R, H)
        every = model.get_decoder()(input_ids=batch.input_ids, attention_mask=batch.attention_mask).last_hidden_state
    assert hidden.is_contiguous() and hidden.shape == (2, 3, 32)
    assert torch.equal(hidden, every[:, 4:7])  # the positions that predict the three response tokens
