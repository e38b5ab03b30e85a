"""Distillation progress on held-out prompts (`data.val_files`, never trained on).

At update 0 (before training), every `eval.every` updates and after the last, the student samples one response
per held-out prompt — with the same sampling streams each time, so the curve is not noise from
new samples — and the teacher scores it:

    k1_mean           mean over response tokens of log pi(y_t) - log nu(y_t)   (a reverse-KL estimate)
    exact_reverse_kl  mean over response positions of sum_v pi(v) (log pi(v) - log nu(v)), the exact
                      KL(student || teacher) of the next-token distributions (vocabularies up to
                      eval.exact_kl_max_vocab; null above)
    teacher_loglik_per_char  with a teacher of another tokenizer (teacher.tokenizer_alignment=text):
                      the teacher's log-likelihood of the student's responses, in its own
                      tokenization, per character of their text (rises as the student writes
                      text the teacher finds likely); k1_mean is then over aligned spans, and the
                      exact KL, which compares two vocabularies, is not measured
    task_score        the mean task reward of the student's own held-out samples, by the rule of each
                      row's data_source (or the run's reward function with task rewards), where every
                      held-out row can be scored (`val/task_score/mean`; else not measured)

The teacher scores each held-out row as it does in training: with several teachers, the row's own;
with a privileged context (`teacher.context`), after its own prompt for that row.

Every forward goes through an out-of-memory downshift (`Downshift`; the run's `eval_downshift`): the
rollout at the rollout physical batch, the teacher and the exact KL at the update chunk, so an
out-of-memory error in the probe halves its rows as it would in an update (and the smaller size
sticks, across a resume too: checkpoints keep it apart, as `eval_downshift`, as of the last probe that
succeeded: halvings that still failed at one row are not kept). It is the probe's
own, not training's: the probe changes no training bit, the sizes that training's checkpoints keep
included, so the resume check's runs can leave it out.
"""

from __future__ import annotations

import logging

import torch

from miniverl.config.reward import RewardConfig
from miniverl.protocol import Batch
from miniverl.trainer.plan import derive_seed, read_rows, teacher_contexts, teacher_routes
from miniverl.utils.dataset import PromptSet, tokenize_prompts
from miniverl.utils.downshift import Downshift
from miniverl.utils.errors import MiniverlError
from miniverl.workers.actor import ActorWorker
from miniverl.workers.factory import with_contexts
from miniverl.workers.full_vocab_loss import exact_reverse_kl
from miniverl.workers.logprobs import output_rows
from miniverl.workers.losses import kl_estimate
from miniverl.workers.reward import RewardWorker
from miniverl.workers.rollout import RolloutWorker
from miniverl.workers.teacher import TeacherRouter, TeacherWorker
from miniverl.workers.text_aligned_teacher import TextAlignedTeacher

# The probe's values under their metric names (the distillation ones are miniverl's).
PROGRESS_METRICS = {
    "k1_mean": "val/distillation/k1_mean",
    "exact_reverse_kl": "val/distillation/exact_reverse_kl",
    "teacher_loglik_per_char": "val/distillation/teacher_loglik_per_char",
    "task_score": "val/task_score/mean",
}


def probe_owed(progress: dict[str, list[dict]], update: int, every: int, last: int) -> bool:
    """Whether `eval.every` (-1: never) puts the held-out probe after `update` updates (0: before
    training; `last`: the plan's final update, probed in any case) and `progress` has no value there
    yet. A run whose probe fails checkpoints the update it followed; its resume measures it first."""
    due = every != -1 and (update % every == 0 or update == last)
    return due and all(point["update"] != update for point in next(iter(progress.values()), []))


class ValidationProbe:
    @classmethod
    def from_config(
        cls, cfg, tokenizer, rollout: RolloutWorker, teacher: TeacherWorker | TeacherRouter, actor: ActorWorker
    ) -> ValidationProbe:
        """The probe of a run: its `data.val_files` prompts, the run's rollout, teacher and actor."""
        rows = read_rows(cfg, "val_files")
        heldout = tokenize_prompts(rows, cfg.data, tokenizer, cfg.recipe.prompt_limit)
        routes = teacher_routes(cfg, heldout.routes, "data.val_files")  # several teachers: each row's, as in training
        contexts = teacher_contexts(cfg, rows, heldout.rows, tokenizer, "data.val_files")  # a teacher's own prompts
        reward = cfg.reward if cfg.estimator.use_task_rewards else RewardConfig()  # else the rules alone
        try:
            scorer = RewardWorker(tokenizer, heldout, reward)
        except MiniverlError:  # a held-out row without a rule or a ground truth: no task score
            scorer = None
        return cls(
            heldout,
            rollout,
            with_contexts(teacher, contexts) if contexts else teacher,
            actor,
            seed=cfg.trainer.seed,
            response_limit=cfg.eval.response_limit or cfg.recipe.response_limit,
            exact_kl_max_vocab=cfg.eval.exact_kl_max_vocab,
            sample_teachers=[routes[row] for row in heldout.rows] if routes else [],
            scorer=scorer,
        )

    def __init__(
        self,
        prompts: PromptSet,
        rollout: RolloutWorker,
        teacher: TeacherWorker | TeacherRouter,
        actor: ActorWorker,
        *,
        seed: int,
        response_limit: int,
        exact_kl_max_vocab: int,
        sample_teachers: list[str] = (),
        scorer: RewardWorker | None = None,
    ):
        self.prompts, self.rollout, self.teacher, self.actor = prompts, rollout, teacher, actor
        self.sample_teachers = list(sample_teachers)  # several teachers: the one of each held-out row
        self.scorer = scorer  # the task reward of the held-out samples, where it can be scored
        self.seeds = [derive_seed(seed, "eval", i) for i in range(len(prompts))]  # the same streams every time
        self.response_limit = response_limit
        self.tokenizer_vocab = rollout.tokenizer_vocab  # the rows every role samples and scores
        self.aligned = isinstance(teacher, TextAlignedTeacher)  # another vocabulary: no exact KL against it
        scored_vocab = output_rows(actor.model.get_output_embeddings(), self.tokenizer_vocab)
        self.exact = scored_vocab <= exact_kl_max_vocab and not self.aligned
        if not self.exact and not self.aligned:  # else the report's null would be the only trace
            logging.getLogger(__name__).warning(
                f"held-out exact reverse KL not computed: the vocabulary ({scored_vocab:,}) is above eval."
                f"exact_kl_max_vocab={exact_kl_max_vocab}; set eval.exact_kl_max_vocab={scored_vocab} to compute it"
            )

    @torch.no_grad()
    def measure(self, shift: Downshift) -> dict[str, float | None]:
        all_rows = [len(self.prompts)]  # not in the plan: all rows, split by the downshift's current sizes
        batch = shift.run(
            "rollout",
            all_rows,
            lambda sizes: self.rollout.generate_sequences(
                self.prompts.token_ids,
                self.prompts.rows,
                self.seeds,
                response_limit=self.response_limit,
                physical_batches=sizes,
            ),
        )
        if self.sample_teachers:
            batch = self.teacher.route(batch, self.sample_teachers)
        exact, per_position = None, None
        if self.exact:  # one teacher forward for both figures: its sampled tokens' log-probs from its full ones
            per_position = shift.run("update_chunk", all_rows, lambda sizes: self.exact_reverse_kl(batch, sizes[0]))
        else:
            score = self.teacher.compute_teacher_log_prob
            batch = shift.run("update_chunk", all_rows, lambda sizes: score(batch, sizes[0]))
        mask = batch.scored_mask  # (B, R)
        tokens = mask.sum().clamp_min(1)
        k1 = float((kl_estimate(batch.rollout_log_probs, batch.teacher_logprobs, "k1") * mask).sum() / tokens)
        if per_position is not None:
            exact = float((per_position * mask).sum() / tokens)
        values = {"k1_mean": k1, "exact_reverse_kl": exact}
        if self.aligned:
            chars = int(batch.response_chars.sum())
            values["teacher_loglik_per_char"] = float(batch.teacher_text_logprobs.sum()) / chars if chars else None
        if self.scorer is not None:
            values["task_score"] = float(self.scorer.compute_reward(batch).token_level_scores.sum(-1).mean())
        return values

    def exact_reverse_kl(self, batch: Batch, rows_per_forward: int) -> torch.Tensor:
        """(B, R) KL(student || teacher) of the next-token distributions, `rows_per_forward` rows
        at a time (each forward holds a (rows, R, V) float32 block per model); fills the batch's
        teacher_logprobs (B, R) from the same teacher forward, where a second forward would score
        the same rows again (a fifth of the real recipe's probe)."""
        parts, sampled = [], []
        for start in range(0, len(batch), rows_per_forward):
            rows = batch.rows(start, start + rows_per_forward)
            student = self.actor.compute_full_log_probs(rows)  # (b, R, V)
            teacher = self.teacher.compute_full_log_probs(rows)  # (b, R, V), each row its own teacher's
            parts.append(exact_reverse_kl(student, teacher))  # (b, R)
            sampled.append(teacher.gather(-1, rows.responses[..., None]).squeeze(-1))  # (b, R)
        batch.teacher_logprobs = torch.cat(sampled) * batch.response_mask
        return torch.cat(parts)
