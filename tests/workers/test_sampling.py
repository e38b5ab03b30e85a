"""The rollout's sampler draws the student's distribution: fed evenly spaced uniforms, its inverse-CDF
draw gives every token a share of the draws equal to its probability (to one draw), with top-k and
top-p the renormalised kept set's, and scores each draw with the unfiltered log-softmax; each row's
draw is its own, however many rows are drawn together."""

from __future__ import annotations

import pytest
import torch

from miniverl.workers.rollout.sampling import CPU_LOGITS_PER_PASS, sample_token

VOCAB, DRAWS = 97, 20_000


def spread_logits() -> torch.Tensor:
    """(3, VOCAB) float32 logits: a flat row, a model-like row, a confident row."""
    generator = torch.Generator().manual_seed(0)
    return torch.randn(3, VOCAB, generator=generator) * torch.tensor([[0.1], [2.0], [6.0]])


def shares_of_draws(logits: torch.Tensor, **filtering) -> torch.Tensor:
    """(rows, VOCAB) the fraction of DRAWS evenly spaced uniforms that land on each token, per row."""
    u = (torch.arange(DRAWS, dtype=torch.float64) + 0.5) / DRAWS  # (DRAWS,): a stratified [0, 1)
    rows = []
    for row in logits:
        token, log_prob = sample_token(row.expand(DRAWS, -1).contiguous(), u, **filtering)
        assert torch.allclose(log_prob, row.log_softmax(-1)[token], atol=1e-5)  # the unfiltered log-prob
        rows.append(torch.bincount(token, minlength=VOCAB).double() / DRAWS)
    return torch.stack(rows)


def test_every_token_is_drawn_with_its_probability():
    logits = spread_logits()
    probabilities = logits.double().softmax(-1)
    # The inverse CDF of stratified uniforms: a token's count is DRAWS * p within one draw.
    assert (shares_of_draws(logits) - probabilities).abs().max() <= 1.0 / DRAWS + 1e-9


@pytest.mark.parametrize("top_k, top_p", [(5, 1.0), (-1, 0.7), (20, 0.9)])
def test_top_k_and_top_p_draw_the_renormalised_kept_tokens(top_k, top_p):
    logits = spread_logits()[1:]  # the model-like and the confident rows
    probabilities = logits.double().softmax(-1)
    order = probabilities.argsort(-1, descending=True)
    kept = torch.zeros_like(probabilities, dtype=torch.bool)
    for r in range(len(logits)):
        ranked = probabilities[r, order[r]]
        if top_k > 0:  # top-k first, then top-p over what it keeps, renormalised (vLLM's, verl's order)
            ranked = torch.where(torch.arange(VOCAB) < top_k, ranked, 0.0)
            ranked = ranked / ranked.sum()
        before = ranked.cumsum(0) - ranked  # the mass ahead of each token
        keep = (before <= top_p) & (ranked > 0)  # up to and with the token that crosses top_p
        kept[r, order[r][keep]] = True
    expected = torch.where(kept, probabilities, 0.0)
    expected = expected / expected.sum(-1, keepdim=True)
    shares = shares_of_draws(logits, top_k=top_k, top_p=top_p)
    assert (shares[~kept] == 0).all()
    assert (shares - expected).abs().max() <= 1.0 / DRAWS + 1e-9


@pytest.mark.parametrize("top_k, top_p", [(-1, 1.0), (50, 0.9)])
def test_rows_drawn_together_are_each_rows_own_draw_when_the_cpu_splits_them_into_passes(top_k, top_p):
    vocab = 2**16  # sampling.CPU_LOGITS_PER_PASS // vocab = 4 rows a pass: 10 rows go as 4, 4 and 2
    assert CPU_LOGITS_PER_PASS // vocab == 4
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(10, vocab, generator=generator) * torch.linspace(0.5, 8.0, 10)[:, None]
    u = torch.rand(10, generator=generator, dtype=torch.float64)
    token, log_prob = sample_token(logits, u, top_k=top_k, top_p=top_p)
    for row in range(10):
        alone = sample_token(logits[row : row + 1], u[row : row + 1], top_k=top_k, top_p=top_p)
        assert torch.equal(token[row : row + 1], alone[0]) and torch.equal(log_prob[row : row + 1], alone[1]), row
    assert len(set(token.tolist())) > 1  # rows of their own, not one row's draw repeated
