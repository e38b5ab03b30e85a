"""estimator.token_selection (TIP, arXiv 2604.14084): the update's loss trains on ceil(keep x N) of the
mini-batch's N response tokens, chosen by the student's entropy (or entropy and divergence), and the
unselected positions never reach the output layer with gradients: the loss is that of a reference
that masks them, and the memory of the update shrinks."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from miniverl.bench.loss_memory import TOPK as K
from miniverl.bench.loss_memory import selection_peaks, toy_actor
from miniverl.config.estimator import EstimatorConfig, TokenSelectionConfig
from miniverl.workers.full_vocab_loss import reverse_kl_full
from miniverl.workers.logprobs import entropy_and_log_probs, response_hidden_states, sampled_log_probs
from miniverl.workers.losses import batch_normalisers, distillation_loss
from miniverl.workers.token_selection import KeptPositions, kept_count, overconfidence_score, select_tokens
from miniverl.workers.topk_loss import forward_kl_topk

# ------------------------------------------------------------------------------------------- a toy actor


# The toy actor of the memory bench: a LoRA student and a teacher, small random Qwen3s, float64 here.
toy = toy_actor


def reference_loss(actor, batch, loss_mask):
    """The textbook loss with `loss_mask` for the response mask (and its normalisers): full logits of
    every position from the student, no chunking, no selection. (loss, per-token loss (B, R))."""
    est = actor.estimator
    actor.peft_model.train()
    head = actor.model.get_output_embeddings()
    logits = head(response_hidden_states(actor.model, batch)) / actor.temperature  # (B, R, V)
    log_prob = logits.log_softmax(-1).gather(-1, batch.responses[..., None]).squeeze(-1)  # (B, R)
    norms = dict(batch_normalisers(loss_mask), loss_scale_factor=actor.loss_scale_factor)
    if est.uses_full_vocab:
        with torch.no_grad():
            teacher = actor.teacher_heads[0](batch.teacher_hidden_states).log_softmax(-1)
        student = logits.log_softmax(-1)
        kl = (student.exp() * (student - teacher)).sum(-1)
        loss, per_token, _ = reverse_kl_full(est, kl, loss_mask, **norms)
    elif est.uses_topk:
        loss, per_token, _ = forward_kl_topk(
            est, logits, batch.teacher_topk_logprobs, batch.teacher_ids, loss_mask, log_prob=log_prob, **norms
        )
    else:
        loss, per_token, _ = distillation_loss(
            est, log_prob, None, batch.teacher_logprobs, loss_mask, advantage_mask=batch.response_mask, **norms
        )
    return loss, per_token


FAMILIES = {
    "k1-pg-discounted": dict(loss_mode="k1", use_policy_gradient=True, kl_discount_factor=0.9, loss_max_clamp=3.0),
    "k3-direct": dict(loss_mode="k3"),
    "topk": dict(loss_mode="forward_kl_topk", topk=K),
    "full-vocab": dict(loss_mode="reverse_kl_full"),
}


def estimator(family: str, by: str = "none", keep: float = 1.0) -> EstimatorConfig:
    return EstimatorConfig(**FAMILIES[family], token_selection=TokenSelectionConfig(by=by, keep=keep))


def lora_grads(actor) -> dict[str, torch.Tensor]:
    grads = {n: p.grad.clone() for n, p in zip(actor.param_names, actor.params)}
    actor.optimizer.zero_grad(set_to_none=True)
    return grads


# ------------------------------------------------------------------------------------------- which tokens


def test_entropy_keeps_the_highest_entropies_and_breaks_ties_by_position():
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    entropy = torch.tensor([[0.5, 2.0, 1.0, 2.0], [3.0, 0.1, 9.0, 9.0]])  # 9.0: padding, never picked
    two = select_tokens("entropy", 1 / 3, mask, entropy)  # ceil(6 / 3) = 2: 3.0, then the first 2.0
    assert two.tolist() == [[False, True, False, False], [True, False, False, False]]
    three = select_tokens("entropy", 0.5, mask, entropy)
    assert three.tolist() == [[False, True, False, True], [True, False, False, False]]
    assert select_tokens("entropy", 1.0, mask, entropy).tolist() == mask.bool().tolist()
    assert select_tokens("none", 1.0, mask, entropy).tolist() == mask.bool().tolist()


def test_overconfident_keeps_low_entropy_high_divergence_tokens_by_standardised_score():
    mask = torch.ones(1, 4)
    # Constant entropy: the largest |k1| (signed k1: its size counts).
    assert select_tokens("overconfident", 0.5, mask, torch.ones(1, 4), torch.tensor([[-3.0, 1, 2, 0.5]])).tolist() == [
        [True, False, True, False]
    ]
    # Constant |k1|: the lowest entropy.
    entropy = torch.tensor([[2.0, 0.1, 1.0, 0.5]])
    assert select_tokens("overconfident", 0.5, mask, entropy, torch.full((1, 4), -2.0)).tolist() == [
        [False, True, False, True]
    ]
    # Both: z(H) = [-3, -1, 1, 3] / sqrt(5), z(|k1|) = [-1, -1, 1, 1]; score = [0.342, -0.553, 0.553, -0.342].
    entropy, k1 = torch.tensor([[0.0, 1.0, 2.0, 3.0]]), torch.tensor([[0.0, 0.0, 3.0, -3.0]])
    score = overconfidence_score(entropy[0], k1[0])
    root5 = math.sqrt(5)
    expected = torch.tensor([-1 + 3 / root5, -1 + 1 / root5, 1 - 1 / root5, 1 - 3 / root5], dtype=torch.float64)
    torch.testing.assert_close(score, expected, rtol=1e-12, atol=1e-12)
    assert select_tokens("overconfident", 0.5, mask, entropy, k1).tolist() == [[True, False, True, False]]


def test_the_kept_count_is_the_ceiling_of_keep_times_the_tokens():
    assert [kept_count(0.1, 30), kept_count(0.25, 7), kept_count(1e-9, 5), kept_count(1.0, 0)] == [3, 2, 1, 0]
    assert kept_count(1e-12, 5) == 1  # too small for the batch: still one token, never an update without a loss


def test_entropies_are_those_of_the_full_softmax_and_log_probs_the_no_grad_paths_bits():
    g = torch.Generator().manual_seed(4)
    head = torch.nn.Linear(16, 50, bias=False)
    hidden, tokens = torch.randn(3, 7, 16, generator=g), torch.randint(0, 45, (3, 7), generator=g)
    log_prob, entropy = entropy_and_log_probs(head, hidden, tokens, temperature=0.7, chunk=4, tokenizer_vocab=45)
    with torch.no_grad():
        assert torch.equal(
            log_prob, sampled_log_probs(head, hidden, tokens, temperature=0.7, chunk=4, tokenizer_vocab=45)
        )
        q = (head.double()(hidden.double())[..., :45] / 0.7).log_softmax(-1)
    torch.testing.assert_close(entropy.double(), -(q.exp() * q).sum(-1), rtol=1e-5, atol=1e-6)


def test_kept_positions_gather_and_scatter_back():
    kept = torch.tensor([[True, False, True], [False, False, True]])
    at = KeptPositions(kept)
    x = torch.arange(18.0).reshape(2, 3, 3)
    assert at.gather(x).shape == (3, 1, 3) and at.gather(x)[:, 0, 0].tolist() == [0.0, 6.0, 15.0]
    assert at.gather_rows(torch.tensor([4, 5])).tolist() == [4, 4, 5]
    values = torch.tensor([[1.0], [2.0], [3.0]], requires_grad=True)
    out = at.scatter(values, base=torch.full((2, 3), -1.0))
    assert out.tolist() == [[1.0, -1.0, 2.0], [-1.0, -1.0, 3.0]]
    out.sum().backward()
    assert values.grad.tolist() == [[1.0], [1.0], [1.0]]


# ------------------------------------------------------------------------------------------- the loss


def test_keep_one_is_no_selection_bit_for_bit():
    results = []
    for by in ("none", "entropy"):
        actor, batch = toy(estimator("k1-pg-discounted", by, 1.0), dtype=torch.float32)
        metrics, per_token, log_probs = actor.accumulate_gradients(batch, [2, 2])
        results.append((metrics, per_token, log_probs, lora_grads(actor)))
    (m0, t0, l0, g0), (m1, t1, l1, g1) = results
    assert m1.pop("actor/distillation/kept_fraction") == 1.0 and m0 == m1
    assert torch.equal(t0, t1) and torch.equal(l0, l1)
    assert all(torch.equal(g0[n], g1[n]) for n in g0)


@pytest.mark.parametrize("by", ["entropy", "overconfident"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_loss_is_that_of_a_reference_that_masks_the_unselected_tokens(family, by):
    """float64: the selected update's loss, per-token loss and LoRA gradients equal the textbook
    loss over full logits with the unselected tokens masked out (and normalised by the kept ones)."""
    actor, batch = toy(estimator(family, by, 0.4))
    selection = actor.select_tokens(batch, [2, 2])
    n, kept = int(batch.response_mask.sum()), selection.kept
    assert int(kept.sum()) == math.ceil(0.4 * n) and not (kept & ~batch.response_mask.bool()).any()
    metrics, per_token, log_probs = actor.accumulate_gradients(batch, [1, 3])
    ours = lora_grads(actor)
    loss_mask = batch.response_mask * kept
    reference, ref_per_token = reference_loss(actor, batch, loss_mask)
    reference.backward()
    theirs = lora_grads(actor)
    assert metrics["actor/distillation/kept_fraction"] == int(kept.sum()) / n
    assert metrics["actor/distillation/loss"] == pytest.approx(float(reference), rel=1e-10, abs=1e-13)
    torch.testing.assert_close(per_token * loss_mask, ref_per_token * loss_mask, rtol=1e-10, atol=1e-12)
    assert any(g.abs().sum() > 0 for g in ours.values())
    for name in ours:
        torch.testing.assert_close(ours[name], theirs[name], rtol=1e-9, atol=1e-12)
    # The log-probs it returns (the on-policy old log-probs) are the policy's at every response token.
    torch.testing.assert_close(log_probs, actor.compute_log_prob(batch, 4), rtol=0, atol=1e-12)


def fix_selection(actor, batch):
    """Makes the selection once, outside what a test measures; the update then reuses it."""
    selection = actor.select_tokens(batch, [4])
    actor.select_tokens = lambda *_: selection
    return selection


class HeadRows(TorchDispatchMode):
    """Counts the positions multiplied with the output layer's weight, every aten product that reads
    its storage: the forward's logits, the fused gradient's (softmax - onehot) @ W, a checkpointed
    chunk's recomputation and the backward's d logits @ W alike."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.ptr, self.rows, self.largest = weight.untyped_storage().data_ptr(), 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default):
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            if any(t.untyped_storage().data_ptr() == self.ptr for t in tensors):
                other = next(t for t in tensors if t.untyped_storage().data_ptr() != self.ptr and t.dim() >= 2)
                self.rows += other.shape[-2]
                self.largest = max(self.largest, other.shape[-2])
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_output_layer_never_sees_an_unselected_position_in_the_update(family):
    counts = []
    for keep in (1.0, 0.25):
        actor, batch = toy(estimator(family, "entropy", keep), dtype=torch.float32)
        selection = fix_selection(actor, batch)  # the selection pass reads every position, without gradients
        with HeadRows(actor.model.get_output_embeddings().weight) as seen:
            actor.accumulate_gradients(batch, [4])
        n_kept = None if selection is None else int(selection.kept.sum())
        counts.append((seen.rows, batch.response_mask.numel(), n_kept))
        assert seen.largest <= (n_kept or actor.logprob_chunk)
    (everything, positions, _), (selected, _, n_kept) = counts
    passes = everything // positions  # the products with W per position: 2 fused, 3 checkpointed
    assert everything == passes * positions and passes >= 2
    assert selected == passes * n_kept  # the kept positions alone, in each of them


@pytest.mark.parametrize("family", ["k3-direct", "topk", "full-vocab"])
def test_training_on_a_quarter_of_the_tokens_needs_far_less_memory(family):
    """keep=0.25 of 102 response tokens (128 positions, V = 8192; `python -m miniverl.bench --losses`
    measures the same): the loss's peak falls with the positions the head sees, and the selection
    pass holds one (positions, V) logits block."""
    everything = selection_peaks(FAMILIES[family], 1.0)["loss"]
    quarter = selection_peaks(FAMILIES[family], 0.25)
    block = 128 * 8192 * 4  # one (B x R, V) float32 block
    assert quarter["loss"] < everything / 3, (quarter, everything)
    assert quarter["selection"] < 1.1 * block, (quarter, block)  # in place: the logits buffer and nothing of its size
    assert quarter["whole"] < 0.6 * everything, (quarter, everything)  # the selection pass included


def test_an_update_with_chunks_that_keep_nothing_trains_and_records_its_columns():
    actor, batch = toy(estimator("k1-pg-discounted", "overconfident", 0.05), dtype=torch.float32)
    expected_old = actor.compute_log_prob(batch, 1)
    trained, metrics = actor.update_actor(batch, [1, 1, 1, 1])  # ceil(0.05 x 20) = 1 token: 3 chunks keep none
    assert metrics["actor/distillation/kept_fraction"] == 1 / 20
    assert int((trained.advantages != 0).sum()) == 1  # the one token trained on
    assert torch.equal(trained.old_log_probs, expected_old)  # every response token's: the policy's own bits
    assert math.isfinite(metrics["actor/grad_norm"]) and metrics["actor/grad_norm"] > 0
