"""Actor role (verl: `compute_log_prob`, `update_actor`): the student's LoRA update.

`update_actor` runs one optimizer step over the whole logical batch (one mini-batch, one epoch):
the rows are processed in update chunks (verl's micro-batches) in train mode (with gradient
checkpointing where `model.gradient_checkpointing` says), each chunk's loss normalised by the
token and sequence counts of the whole mini-batch, so the accumulated gradient does not depend
on the chunking.

Old log-probs. One mini-batch and one epoch make the update on-policy: the weights being updated are
the ones that sampled. So when the batch has no `old_log_probs`, the update's own forward gives them
(detached: the PPO ratio is exactly 1) and fills the column (`old_log_probs_for` decides, in one
place). verl computes them in a pass of its own before the update (`compute_log_prob`, eval mode, no
autograd); verl v0.6/v0.7 then used `log_prob.detach()` in the loss anyway when on-policy (PR
#3119), as miniverl does, but still ran that pass. miniverl skips it: one forward pass fewer per
update, bitwise the same values on the CPU (tested). With dropout in the model (e.g.
`model.lora.dropout` > 0) the train-mode forward is a random draw, not the policy, so the separate
pass runs instead.

Beyond verl (docs/objectives.md): with `estimator.kl_discount_factor` the distillation policy
gradient's advantage is the discounted future KL (`advantages.policy_gradient_advantages`), with
`estimator.advantage_baseline` less one number per update (`baseline_for`), and it is what the
batch's `advantages` column holds; with `estimator.token_selection` a no-gradient pass
before the update chunks picks the response tokens the loss trains on and only those reach the
output layer with gradients (`miniverl.workers.token_selection`).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import NamedTuple

import torch
from peft import PeftModel

from miniverl.config.actor import ActorConfig
from miniverl.config.estimator import EstimatorConfig
from miniverl.models import cpu_gemm
from miniverl.models.randomness import train_forward_is_random
from miniverl.protocol import Batch
from miniverl.utils.run_names import LOSS_KEY
from miniverl.workers.actor_metrics import per_teacher_losses, rollout_actor_metrics
from miniverl.workers.advantages import policy_gradient_advantages
from miniverl.workers.full_vocab_loss import reverse_kl_full, reverse_kl_full_terms
from miniverl.workers.logprobs import (
    full_log_probs,
    response_hidden_states,
    response_log_probs,
    sampled_log_probs,
    topk_terms,
)
from miniverl.workers.losses import (
    Spans,
    batch_normalisers,
    combine_metrics,
    distillation_baseline,
    distillation_loss,
)
from miniverl.workers.task_loss import distillation_ppo_loss
from miniverl.workers.token_selection import TokenSelection, select_for_update
from miniverl.workers.topk_loss import topk_distillation_loss


class Accumulated(NamedTuple):
    """What the backward over an update's chunks leaves."""

    metrics: dict[str, float]
    per_token_loss: torch.Tensor  # (B, R) the distillation loss
    log_probs: torch.Tensor  # (B, R) the forward's: the policy before the step
    loss_mask: torch.Tensor | None  # (B, R) the tokens trained on; None: every response token
    baseline: float  # the advantage's (estimator.advantage_baseline): one number for the update


class NonFiniteLoss(Exception):
    """A NaN or infinite loss or gradient norm: the update is not applied."""


class ActorWorker:
    def __init__(
        self,
        model: PeftModel,
        actor: ActorConfig,
        estimator: EstimatorConfig,
        *,
        temperature: float,
        logprob_chunk: int,
        loss_scale_factor: int,
        tokenizer_vocab: int | None = None,
        float32_gemm: bool = False,
        bypass_mode: bool = False,
        teacher_names: tuple[str, ...] = (),
        teacher_heads: tuple[torch.nn.Module, ...] = (),
        alignment_credit: str = "last",
    ):
        self.peft_model = model
        self.bypass_mode = bypass_mode  # verl's rollout_correction.bypass_mode: the rollout's log-probs are old
        self.alignment_credit = alignment_credit  # a teacher with another tokenizer: how a span's estimate is credited
        self.model = model.get_base_model()  # LoRA layers are injected in place
        self.estimator = estimator
        self.actor_config = actor  # its clip ratios are the task-reward PPO loss's (verl's actor ones)
        self.grad_clip = actor.grad_clip
        self.temperature = temperature
        self.logprob_chunk = logprob_chunk
        self.tokenizer_vocab = tokenizer_vocab  # output rows past it are padding: never scored
        self.float32_gemm = float32_gemm  # CPU only: see cpu_gemm
        self.teacher_names = teacher_names  # several teachers: batch.teacher_index i is teacher_names[i]
        self.teacher_heads = teacher_heads  # reverse_kl_full: each teacher's output layer, by teacher_index
        # seq-mean-token-sum-norm divides by the padded response length; verl pads responses to
        # max_response_length, so that (not the batch's longest response) is the divisor.
        self.loss_scale_factor = loss_scale_factor
        trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]  # the LoRA matrices only
        self.param_names = [n for n, _ in trainable]  # names key the optimizer state in checkpoints
        self.params = [p for _, p in trainable]
        self.optimizer = torch.optim.AdamW(
            self.params,
            lr=actor.optim.lr,
            betas=tuple(actor.optim.betas),
            eps=actor.optim.eps,
            weight_decay=actor.optim.weight_decay,
        )
        self.random_train_forward = train_forward_is_random(self.model)  # peft's lora_dropout too: injected in place

    @torch.no_grad()
    def compute_full_log_probs(self, batch: Batch) -> torch.Tensor:
        """(B, R, V) the policy's next-token log-probs over the tokenizer's ids at temperature 1 (the held-out
        exact KL; small vocabularies only), as the teacher's `compute_full_log_probs`."""
        self.peft_model.eval()
        with cpu_gemm.float32_products(self.model, self.float32_gemm):
            return full_log_probs(self.model, batch, self.tokenizer_vocab)

    @torch.no_grad()
    def compute_log_prob(self, batch: Batch, rows_per_forward: int) -> torch.Tensor:
        """(B, R) float32 old log-probs of the current policy."""
        self.peft_model.eval()
        with cpu_gemm.float32_products(self.model, self.float32_gemm):
            parts = [
                response_log_probs(
                    self.model,
                    batch.rows(s, s + rows_per_forward),
                    temperature=self.temperature,
                    chunk=self.logprob_chunk,
                    tokenizer_vocab=self.tokenizer_vocab,
                )
                for s in range(0, len(batch), rows_per_forward)
            ]
        return torch.cat(parts) * batch.response_mask

    def old_log_probs_for(self, batch: Batch, rows_per_forward: int) -> torch.Tensor | None:
        """The old log-probs an update of `batch` uses, (B, R): the batch's own if it has them, the
        rollout's in bypass mode (verl's rollout_correction.bypass_mode), a separate eval-mode pass
        when the train forward is a random draw (dropout); None: the update's own forward's
        (on-policy: the PPO ratio is exactly 1, and the loss functions read None so)."""
        if batch.old_log_probs is not None:
            return batch.old_log_probs
        if self.bypass_mode:
            return batch.rollout_log_probs.clone()  # own storage: safetensors refuses shared ones
        if self.random_train_forward:
            return self.compute_log_prob(batch, rows_per_forward)
        return None

    def update_actor(
        self, batch: Batch, chunks: list[int], dropout_seed: int | None = None
    ) -> tuple[Batch, dict[str, float]]:
        """One optimizer step on `batch` (needs the teacher's columns). Returns the batch with the
        actor's columns filled — old_log_probs (`old_log_probs_for`, else this update's own
        forward's) and, for the policy-gradient estimators, advantages — and the update's metrics.
        The batch is written only once the step is taken, so an out-of-memory retry at smaller
        chunks starts again from the batch as it came. `dropout_seed`: the update's, for a model whose
        train forward draws (dropout masks, a router's jitter: from torch's global generators, CPU and
        CUDA; seeded per update, a resumed run draws what the uninterrupted one drew)."""
        if self.random_train_forward and dropout_seed is not None:
            torch.manual_seed(dropout_seed)
        given = self.old_log_probs_for(batch, chunks[0])
        with cpu_gemm.float32_products(self.model, self.float32_gemm):  # the recomputed forward too
            step = self._step(replace(batch, old_log_probs=given), chunks)
        metrics, loss_mask = step.metrics, step.loss_mask
        batch.old_log_probs = step.log_probs if given is None else given
        # Memory: the teacher's hidden states (B, R, H) are read only by this update's loss.
        batch.teacher_hidden_states = None
        if self.estimator.use_policy_gradient:
            # What the PG step maximised at each token: -d_t, or the discounted future loss over the
            # scored response (kl_discount_factor), less the baseline: the loss's function on the loss's
            # values and mask (_chunk_loss's advantage_mask), so the column is what was trained on.
            advantages = policy_gradient_advantages(
                self.estimator, step.per_token_loss, batch.scored_mask, step.baseline
            )
            batch.advantages = advantages if loss_mask is None else advantages * loss_mask  # 0: not trained on
        if not self.bypass_mode:
            metrics.update(rollout_actor_metrics(batch))
        if batch.teacher_index is not None:
            trained = batch if loss_mask is None else replace(batch, response_mask=loss_mask)
            metrics.update(per_teacher_losses(step.per_token_loss, trained, self.teacher_names))
        return batch, metrics

    def baseline_for(self, batch: Batch) -> float:
        """The number subtracted from each token's estimate in the advantage (estimator.advantage_baseline),
        from the log-probs of the policy that sampled `batch`: its old log-probs, on-policy the rollout's."""
        sampled_by = batch.rollout_log_probs if batch.old_log_probs is None else batch.old_log_probs
        return distillation_baseline(
            self.estimator, sampled_by, batch.teacher_logprobs, batch.scored_mask, self.spans_of(batch)
        )

    def spans_of(self, batch: Batch) -> Spans | None:
        """The span targets of a teacher with another tokenizer (None: per-token teacher log-probs)."""
        if batch.student_span is None:
            return None
        return Spans(batch.student_span, batch.teacher_span_logprobs, self.alignment_credit)

    def _step(self, batch: Batch, chunks: list[int]) -> Accumulated:
        accumulated = self._accumulate(batch, chunks)
        metrics = accumulated.metrics
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, self.grad_clip))
        loss = metrics[LOSS_KEY] + metrics.get("actor/pg_loss", 0.0)
        if not (math.isfinite(grad_norm) and math.isfinite(loss)):
            # verl skips such a step and goes on; miniverl stops, so a diverging run does not burn
            # hours: the weights stay those of the last complete update.
            self.optimizer.zero_grad(set_to_none=True)
            raise NonFiniteLoss(
                f"non-finite loss {loss} / gradient norm {grad_norm}; "
                "lower actor.optim.lr, set estimator.loss_max_clamp, or check the teacher's log-probs"
            )
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)  # frees the gradients before the next rollout
        self.peft_model.eval()
        metrics["actor/grad_norm"] = grad_norm
        metrics["actor/lr"] = self.optimizer.param_groups[0]["lr"]
        return accumulated

    def select_tokens(self, batch: Batch, chunks: list[int]) -> TokenSelection | None:
        """The response tokens this update trains on (estimator.token_selection), from a no-gradient
        eval-mode pass over the mini-batch (its rows in `chunks`); None: every response token (by=none,
        and keep=1, which keeps them all without ranking them)."""
        select = self.estimator.token_selection
        if select.by == "none" or select.keep >= 1:
            return None
        self.peft_model.eval()
        return select_for_update(
            self.model,
            batch,
            select.by,
            select.keep,
            chunks,
            temperature=self.temperature,
            chunk=self.logprob_chunk,
            tokenizer_vocab=self.tokenizer_vocab,
        )

    def accumulate_gradients(
        self, batch: Batch, chunks: list[int]
    ) -> tuple[dict[str, float], torch.Tensor, torch.Tensor]:
        """Backward over the update chunks; the chunk losses sum to the mini-batch loss. Returns the
        metrics, the per-token distillation loss (B, R) and this forward's log-probs (B, R): the
        policy before the step, what on-policy old log-probs are."""
        accumulated = self._accumulate(batch, chunks)
        return accumulated.metrics, accumulated.per_token_loss, accumulated.log_probs

    def _accumulate(self, batch: Batch, chunks: list[int]) -> Accumulated:
        """`accumulate_gradients`, with the mask of the tokens the loss trained on and the baseline.
        With token selection the per-token loss is 0 at the unselected positions of the top-k and
        full-vocabulary losses (never computed), the estimate itself for the single-sample estimators
        (from the selection pass's log-probs), and the log-probs there are the selection pass's."""
        selection = self.select_tokens(batch, chunks)  # before train(): the policy's own entropies
        self.peft_model.train()
        self.optimizer.zero_grad(set_to_none=True)
        loss_mask = None if selection is None else selection.loss_mask(batch.response_mask)
        if batch.student_span is not None:  # a teacher with another tokenizer: its unaligned tokens are left out
            loss_mask = batch.scored_mask
        trained = batch.response_mask if loss_mask is None else loss_mask
        normalisers = dict(batch_normalisers(trained), loss_scale_factor=self.loss_scale_factor)
        baseline = self.baseline_for(batch)  # one number for the whole update, before any chunk's backward
        total_loss, with_task, parts, per_token, log_probs, start = 0.0, 0.0, [], [], [], 0
        for size in chunks:
            chunk = batch.rows(start, start + size)
            picked = None if selection is None else selection.rows(start, start + size)
            chunk_mask = trained[start : start + size]
            start += size
            loss, chunk_per_token, metrics, log_prob = self._chunk_loss(chunk, normalisers, picked, baseline)
            loss_with_task, task_metrics = distillation_ppo_loss(  # verl's, with or without task rewards
                self.estimator,
                self.actor_config,
                loss,
                log_prob,
                chunk.old_log_probs,
                chunk.task_advantages,
                chunk_mask,  # the task loss trains on the selected tokens too: the others have no gradient
                **normalisers,
            )
            metrics.update(task_metrics)
            if picked is None or loss_with_task.requires_grad:  # a chunk with no kept token has no gradient
                loss_with_task.backward()
            total_loss += float(loss.detach())
            with_task += float(loss_with_task.detach())
            parts.append((metrics, float(chunk_mask.sum())))
            per_token.append(chunk_per_token.detach())
            log_probs.append(log_prob.detach())  # (size, R): the policy before this step
        metrics = {f"actor/{k}": float(v) for k, v in combine_metrics(parts).items()}
        metrics[LOSS_KEY] = total_loss  # before distillation_loss_coef, as verl logs it
        metrics["actor/loss"] = with_task  # the loss trained on: verl's, the task loss + coef x distillation
        if self.estimator.advantage_baseline != "none":
            metrics["actor/distillation/advantage_baseline"] = baseline
        if self.estimator.token_selection.by != "none":
            n = float(batch.response_mask.sum())
            metrics["actor/distillation/kept_fraction"] = float(trained.sum()) / n if n else 1.0
        # actor/pg_clipfrac, actor/ppo_kl, actor/pg_clipfrac_lower are verl's names for the task PPO loss:
        # logged with task rewards only. The distillation policy gradient's are actor/distillation/*.
        mask = batch.response_mask
        return Accumulated(metrics, torch.cat(per_token) * mask, torch.cat(log_probs) * mask, loss_mask, baseline)

    def _chunk_loss(
        self, chunk: Batch, normalisers: dict, selection: TokenSelection | None = None, baseline: float = 0.0
    ):
        """(loss, per-token loss, metrics, log_prob (b, R) with its graph); old_log_probs None: on-policy.

        selection: the kept tokens of these rows. The loss trains on response_mask & kept; the
        output layer sees only the kept positions' hidden states (gathered, (N, 1, H)), and the
        per-position results come back as (b, R), 0 elsewhere (the log-probs: the selection pass's)."""
        est = self.estimator
        lm_head = self.model.get_output_embeddings()
        at = None if selection is None else selection.positions()
        if at is not None and at.count == 0:  # nothing kept in these rows: no decoder forward either
            hidden = lm_head.weight.new_empty(*at.shape, lm_head.weight.shape[1])
        else:
            hidden = response_hidden_states(self.model, chunk)  # (b, R, H)
        mask = chunk.scored_mask if selection is None else selection.loss_mask(chunk.response_mask)

        def per_position(x):  # (b, R, ...) -> the positions the head sees
            return x if at is None else at.gather(x)

        def back(x, base=None):  # the head's results -> (b, R, ...): a tensor, or a NamedTuple of them, field by field
            if at is None or x is None:
                return x
            return type(x)(*(back(t) for t in x)) if isinstance(x, tuple) else at.scatter(x, base)

        base = None if selection is None else selection.log_probs
        if est.uses_full_vocab:
            index = chunk.teacher_index
            log_prob, kl = reverse_kl_full_terms(
                lm_head,
                per_position(hidden),
                per_position(chunk.responses),
                self.teacher_heads,
                per_position(chunk.teacher_hidden_states),
                index if at is None or index is None else at.gather_rows(index),  # (N,): per kept position
                temperature=self.temperature,
                chunk=self.logprob_chunk,
                tokenizer_vocab=self.tokenizer_vocab,
                # reverse_kl_topk: the sum over the student's own top-k (`kl` is then a NamedTuple of (b, R)
                # terms: back() scatters it field by field).
                topk=est.topk if est.loss_mode == "reverse_kl_topk" else None,
            )
            return (*reverse_kl_full(est, back(kl), mask, **normalisers), back(log_prob, base))
        if not est.uses_topk:
            log_prob = back(
                sampled_log_probs(
                    lm_head,
                    per_position(hidden),
                    per_position(chunk.responses),
                    temperature=self.temperature,
                    chunk=self.logprob_chunk,
                    tokenizer_vocab=self.tokenizer_vocab,
                ),
                base,
            )
            return (
                *distillation_loss(
                    est,
                    log_prob,
                    chunk.old_log_probs,
                    chunk.teacher_logprobs,
                    mask,
                    advantage_mask=chunk.scored_mask,  # the discounted future KL runs over the scored response
                    baseline=baseline,
                    spans=self.spans_of(chunk),
                    **normalisers,
                ),
                log_prob,
            )
        log_prob, terms = topk_terms(
            lm_head,
            per_position(hidden),
            per_position(chunk.responses),
            per_position(chunk.teacher_ids),
            per_position(chunk.teacher_topk_logprobs),
            temperature=self.temperature,
            log_prob_min_clamp=est.log_prob_min_clamp,
            # Positions are always taken in chunks here, their logits recomputed in the backward; verl 0.9's
            # use_chunked_topk caps the chunk at chunked_topk_chunk_size positions (a smaller one only saves memory).
            chunk=min(self.logprob_chunk, est.chunked_topk_chunk_size) if est.use_chunked_topk else self.logprob_chunk,
            tokenizer_vocab=self.tokenizer_vocab,
        )
        log_prob, terms = back(log_prob, base), back(terms)
        return (
            *topk_distillation_loss(
                est, terms, mask, log_prob=log_prob, old_log_prob=chunk.old_log_probs, **normalisers
            ),
            log_prob,
        )
