"""Distillation progress on held-out prompts (`data.val_files`, never trained on).

At update 0 (before training) and every `eval.every` updates, the student samples one response
per held-out prompt — with the same sampling streams each time, so the curve is not noise from
new samples — and the teacher scores it:

    k1_mean           mean over response tokens of log pi(y_t) - log nu(y_t)   (a reverse-KL estimate)
    exact_reverse_kl  mean over response positions of sum_v pi(v) (log pi(v) - log nu(v)), the exact
                      KL(student || teacher) of the next-token distributions (vocabularies up to
                      eval.exact_kl_max_vocab; null above)
"""

from __future__ import annotations

import torch

from miniverl.batch import Batch
from miniverl.data import PromptSet
from miniverl.logprobs import response_hidden_states
from miniverl.plan import derive_seed, split
from miniverl.rollout import RolloutWorker
from miniverl.teacher import TeacherWorker


def full_log_probs(model, batch: Batch) -> torch.Tensor:
    """(B, R, V) float32 next-token log-probs at the response positions (small vocabularies only)."""
    hidden = response_hidden_states(model, batch)
    return model.get_output_embeddings()(hidden).float().log_softmax(-1)


class DistillationProbe:
    def __init__(self, prompts: PromptSet, rollout: RolloutWorker, teacher: TeacherWorker, student_model, *,
                 seed: int, response_limit: int, rows_per_forward: int, exact_kl_max_vocab: int):
        self.prompts, self.rollout, self.teacher, self.student_model = prompts, rollout, teacher, student_model
        self.seeds = [derive_seed(seed, "eval", i) for i in range(len(prompts))]  # the same streams every time
        self.response_limit = response_limit
        self.rows_per_forward = rows_per_forward
        vocab = student_model.get_output_embeddings().weight.shape[0]
        self.exact = vocab <= exact_kl_max_vocab

    @torch.no_grad()
    def measure(self) -> dict[str, float | None]:
        batch = self.rollout.generate_sequences(
            self.prompts.token_ids, self.prompts.rows, self.seeds, response_limit=self.response_limit,
            physical_batches=split(len(self.prompts), self.rows_per_forward))
        batch = self.teacher.compute_teacher_log_prob(batch, self.rows_per_forward)
        mask = batch.response_mask  # (B, R)
        tokens = mask.sum().clamp_min(1)
        k1 = float(((batch.rollout_log_probs - batch.teacher_logprobs) * mask).sum() / tokens)
        exact = None
        if self.exact:
            student = full_log_probs(self.student_model, batch)  # (B, R, V)
            self.teacher.model.eval()
            with self.teacher.context():
                teacher = full_log_probs(self.teacher.model, batch)
            per_position = (student.exp() * (student - teacher)).sum(-1)  # (B, R)
            exact = float((per_position * mask).sum() / tokens)
        return {"k1_mean": k1, "exact_reverse_kl": exact}
