"""Which response tokens an update's loss trains on (`estimator.token_selection`, after TIP,
arXiv 2604.14084), and training on those alone.

Per update (the whole mini-batch, before its update chunks) a no-gradient pass of the student
(eval mode, as `compute_log_prob`) gives, at every response position, the sampled token's
log-prob and the entropy H_t = -sum_v q_v log q_v of the next-token distribution q (at the rollout
temperature), one chunk of positions at a time (never a (B, R, V) tensor). Of the N response tokens
of the mini-batch, n = ceil(keep x N) are kept:

* `entropy`: the n with the highest H_t (the student's forks, where it is unsure);
* `overconfident`: the n with the highest score_t = z(|k1_t|) - z(H_t), low entropy and high
  divergence: k1_t = log pi(y_t) - log nu(y_t), the student's log-prob (this pass) minus the
  teacher's of the sampled token, and z(x) = (x - mean x) / std x, the mean and (population)
  standard deviation over the mini-batch's response tokens (z = 0 for a constant x);

ties broken by position, the first in row-major (row, position) order first (a stable sort).

The loss then trains on the kept tokens only: its mask is response_mask & kept, its normalisers
(token and row counts) are the kept tokens', and the unselected positions never reach the output
layer with gradients: the kept positions' hidden states are gathered from the decoder's output,
(B, R, H) -> (N_kept, 1, H), the per-position head functions run on those, and their results are
scattered back to (B, R) (`KeptPositions`). Where the loss needs a value at an unselected position
(the sampled token's log-prob, for the discounted advantage and the old log-probs) it is this
pass's, without gradient.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from miniverl.protocol import Batch
from miniverl.workers.logprobs import response_entropy_and_log_probs


def kept_count(keep: float, n_tokens: int) -> int:
    """ceil(keep x n_tokens), read to 9 decimals (0.1 x 30 is 3, not 4 from 3.0000000000000004), and at
    least one token of a batch that has any: a keep too small for the batch still trains on one."""
    return min(n_tokens, max(1 if n_tokens else 0, math.ceil(round(keep * n_tokens, 9))))


def standardised(values: torch.Tensor) -> torch.Tensor:
    """(x - mean) / std over a 1-d tensor, float64, population std; 0 everywhere when x is constant."""
    x = values.double()
    centred = x - x.mean()
    std = centred.square().mean().sqrt()
    return centred / std if std > 0 else torch.zeros_like(x)


def overconfidence_score(entropy: torch.Tensor, divergence: torch.Tensor) -> torch.Tensor:
    """score = z(|divergence|) - z(entropy), over the given tokens (1-d, float64): high for a confident
    (low entropy) token the teacher disagrees with (high |k1|)."""
    return standardised(divergence.abs()) - standardised(entropy)


def select_tokens(
    by: str,
    keep: float,
    response_mask: torch.Tensor,
    entropy: torch.Tensor,
    divergence: torch.Tensor | None = None,
) -> torch.Tensor:
    """The kept tokens, (B, R) bool, a subset of response_mask (B, R): ceil(keep x N) of its N tokens,
    the highest `entropy` (by=entropy) or the highest overconfidence_score(entropy, divergence)
    (by=overconfident); ties to the first position (row-major). by=none: every response token."""
    mask = response_mask.bool()
    if by == "none":
        return mask.clone()
    flat_mask = mask.reshape(-1)
    where = flat_mask.nonzero().squeeze(1)  # (N,) response tokens, in row-major order
    if by == "entropy":
        score = entropy.reshape(-1)[where].double()
    elif by == "overconfident":
        if divergence is None:
            raise ValueError("token_selection.by=overconfident needs the divergence of each token")
        score = overconfidence_score(entropy.reshape(-1)[where], divergence.reshape(-1)[where])
    else:
        raise ValueError(f"unknown token_selection.by={by!r}; choose none, entropy or overconfident")
    order = torch.sort(score, descending=True, stable=True).indices  # stable: ties keep row-major order
    kept = torch.zeros_like(flat_mask)
    kept[where[order[: kept_count(keep, where.numel())]]] = True
    return kept.reshape(mask.shape)


@dataclass
class TokenSelection:
    """One update's selection: kept (B, R) bool, the response tokens the loss trains on; log_probs
    (B, R) float32, the student's sampled-token log-probs from the selection pass (0 off the
    response), the values at the positions the loss does not recompute."""

    kept: torch.Tensor
    log_probs: torch.Tensor

    def rows(self, start: int, stop: int) -> TokenSelection:
        return TokenSelection(self.kept[start:stop], self.log_probs[start:stop])

    def loss_mask(self, response_mask: torch.Tensor) -> torch.Tensor:
        """response_mask & kept, in response_mask's dtype."""
        return response_mask * self.kept.to(response_mask.dtype)

    def positions(self) -> KeptPositions:
        return KeptPositions(self.kept)


def select_for_update(
    model: torch.nn.Module,
    batch: Batch,
    by: str,
    keep: float,
    chunks: list[int],
    *,
    temperature: float,
    chunk: int,
    tokenizer_vocab: int | None,
) -> TokenSelection:
    """The selection of one update: a no-gradient pass over `batch` (rows in `chunks`, positions
    `chunk` at a time; the caller sets eval mode) for the log-probs and entropies, then
    `select_tokens` over the whole mini-batch."""
    log_probs, entropies, start = [], [], 0
    for size in chunks:
        rows = batch.rows(start, start + size)
        lp, h = response_entropy_and_log_probs(
            model, rows, temperature=temperature, chunk=chunk, tokenizer_vocab=tokenizer_vocab
        )
        log_probs.append(lp)
        entropies.append(h)
        start += size
    log_prob, entropy = torch.cat(log_probs), torch.cat(entropies)  # (B, R) each
    divergence = None
    if by == "overconfident":
        divergence = log_prob - batch.teacher_logprobs.to(log_prob.dtype)  # k1 of the sampled token
    kept = select_tokens(by, keep, batch.response_mask, entropy, divergence)
    return TokenSelection(kept=kept, log_probs=log_prob * batch.response_mask)


class KeptPositions:
    """The kept positions of a (b, R) chunk, to run the per-position functions on them alone.

    `gather` takes (b, R, ...) to (N, 1, ...): each kept position becomes a row of length 1, so a
    per-row argument (the teacher index) is gathered per position too (`gather_rows`); `scatter`
    takes the results (N, 1, ...) back to (b, R, ...), zeros (or `base`) elsewhere, differentiably
    with respect to the results only."""

    def __init__(self, kept: torch.Tensor):
        self.shape = tuple(kept.shape)  # (b, R)
        self.index = kept.reshape(-1).nonzero().squeeze(1)  # (N,) flat positions, row-major
        self.row, self.column = self.index // self.shape[1], self.index % self.shape[1]

    @property
    def count(self) -> int:
        return self.index.numel()

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """(b, R, ...) -> (N, 1, ...): indexes x where it lies (no copy of all of x, if a strided view)."""
        return x[self.row, self.column].unsqueeze(1)

    def gather_rows(self, x: torch.Tensor) -> torch.Tensor:
        """(b, ...) per-row values -> (N, ...), each kept position's row's."""
        return x[self.row]

    def scatter(self, values: torch.Tensor, base: torch.Tensor | None = None) -> torch.Tensor:
        """(N, 1, ...) -> (b, R, ...): the values at the kept positions, `base` (detached; default 0)
        elsewhere."""
        flat = values.reshape(self.count, *values.shape[2:])
        size = self.shape[0] * self.shape[1]
        if base is None:
            out = torch.zeros(size, *flat.shape[1:], dtype=flat.dtype, device=flat.device)
        else:
            out = base.detach().to(flat.dtype).reshape(size, *flat.shape[1:])
        return out.index_copy(0, self.index, flat).reshape(*self.shape, *flat.shape[1:])
