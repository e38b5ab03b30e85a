"""Teacher role (verl: `compute_teacher_log_prob`): the frozen teacher scores the sampled tokens.

One forward over prompt + response per chunk of rows; only the log-prob of the token the student
sampled is kept at each position (`teacher_target: sampled_token_log_probability`).
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from miniverl.batch import Batch
from miniverl.logprobs import response_log_probs


class TeacherWorker:
    def __init__(self, model: PreTrainedModel, *, rows_per_forward: int, logprob_chunk: int):
        self.model = model.eval()
        self.rows_per_forward = rows_per_forward
        self.logprob_chunk = logprob_chunk

    @torch.inference_mode()
    def compute_teacher_log_prob(self, batch: Batch) -> torch.Tensor:
        """(B, R) float32: log nu(y_t | x, y_<t) at temperature 1 (verl requires 1.0 for the teacher)."""
        parts = [response_log_probs(self.model, batch.rows(start, start + self.rows_per_forward),
                                    chunk=self.logprob_chunk)
                 for start in range(0, len(batch), self.rows_per_forward)]
        return torch.cat(parts) * batch.response_mask
