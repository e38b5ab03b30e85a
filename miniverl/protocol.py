"""`Batch`: the one object the trainer passes between the roles, like verl's DataProto.

Names follow verl's data columns. Shapes: B rows (samples), P prompt positions (left-padded to
the longest prompt of the logical batch), R response positions (right-padded to the longest
response of the logical batch), L = P + R.

    prompt_rows        (B,)    long   parquet row of each sample's prompt
    prompts            (B, P)  long   prompt token ids, left-padded with pad_token_id
    responses          (B, R)  long   sampled token ids, right-padded after EOS
    input_ids          (B, L)  long   prompts ++ responses
    attention_mask     (B, L)  long   1 on real prompt tokens and on response tokens up to EOS
    position_ids       (B, L)  long   cumsum(attention_mask) - 1, clamped at 0
    response_mask      (B, R)  float  1 on response tokens up to and including EOS (verl's mask)
    rollout_log_probs  (B, R)  float32  log pi(y_t) recorded while sampling     [rollout]
    teacher_logprobs   (B, R)  float32  log nu(y_t), the teacher's              [teacher]
    teacher_topk_logprobs (B, R, k) float32  the teacher's k largest log-probs  [teacher, top-k only]
    teacher_ids        (B, R, k) long  their token ids                          [teacher, top-k only]
    teacher_hidden_states (B, R, H) the teacher's final hidden states at the response positions
                                   [teacher, reverse_kl_full / reverse_kl_topk only; the actor drops them after its
                                   update, they never reach the trajectory log]
    old_log_probs      (B, R)  float32  log pi_old(y_t): the update's own forward's (on-policy), the rollout's
                                        (bypass_mode), or an eval-mode pass's (a model with dropout) [actor]
    advantages         (B, R)  float32  the distillation PG advantage: -(loss), clamped, or with kl_discount_factor the
                                        discounted future -(loss), less advantage_baseline's b first; 0 on tokens a
                                        token_selection left out                   [actor, PG]
    token_level_scores (B, R)  float32  the task reward, at each sample's last response token [reward]
    task_advantages    (B, R)  float32  GRPO / RLOO advantage of the task reward, on every response
                                        token                                     [advantage]
    teacher_index      (B,)    long   which of several teachers scores each sample (its position in
                                      `teachers`; the plan's sample_teachers)      [teacher router]

A teacher with another tokenizer (teacher.tokenizer_alignment=text) scores spans of the response's
text (miniverl/utils/text_alignment.py) and fills, instead of per-token values:

    student_span       (B, R)  long   each response token's span, -1 where unaligned (never trained on)
    teacher_span_logprobs (B, S) float32  log nu(span): the sum of the teacher's token log-probs over
                                      the span, in its own tokenization; S the most spans of a row
    teacher_logprobs   (B, R)  float32  log nu(span) credited to the span's student tokens (alignment_credit)
    teacher_text_logprobs (B,) float32  the teacher's log-likelihood of the whole response text (its stop
                                      token included when the student stopped)
    response_chars     (B,)    long   characters of the response text
    response_bytes     (B,)    long   bytes of the response text            [with teacher.unwritable_byte_log_prob]
    unwritable_bytes   (B,)    long   of those, the bytes the teacher's vocabulary cannot write that the
                                      loss scored at that floor (in aligned spans) [the same]

verl's batch carries the teacher's output as `teacher_logprobs`/`teacher_ids` with a last
dimension of k (1 for the single-sample estimators); miniverl keeps the sampled token's
log-prob as a (B, R) `teacher_logprobs` in every mode and the top-k in `teacher_topk_logprobs`.
verl's `advantages` column is the task advantages, miniverl's `task_advantages`; miniverl's
`advantages` is the distillation policy gradient's (kept under that name since the first
release, so pure-distillation trajectories keep their bytes). verl's `token_level_rewards`
equal `token_level_scores` here (no KL in the reward): they are not stored twice.
With `rollout.n` > 1 a prompt's samples are adjacent rows (verl's interleaved repeat).

Position t of every (B, R) tensor is about response token t given everything before it.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch


@dataclass
class Batch:
    prompt_rows: torch.Tensor
    prompts: torch.Tensor
    responses: torch.Tensor
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    response_mask: torch.Tensor
    rollout_log_probs: torch.Tensor
    teacher_logprobs: torch.Tensor | None = None
    teacher_topk_logprobs: torch.Tensor | None = None
    teacher_ids: torch.Tensor | None = None
    teacher_hidden_states: torch.Tensor | None = None
    old_log_probs: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    token_level_scores: torch.Tensor | None = None
    task_advantages: torch.Tensor | None = None
    teacher_index: torch.Tensor | None = None
    student_span: torch.Tensor | None = None
    teacher_span_logprobs: torch.Tensor | None = None
    teacher_text_logprobs: torch.Tensor | None = None
    response_chars: torch.Tensor | None = None
    response_bytes: torch.Tensor | None = None
    unwritable_bytes: torch.Tensor | None = None

    @property
    def scored_mask(self) -> torch.Tensor:
        """(B, R) the response tokens the teacher's values cover: every one, but for the tokens a
        text alignment left unaligned."""
        if self.student_span is None:
            return self.response_mask
        return self.response_mask * (self.student_span >= 0).to(self.response_mask.dtype)

    @property
    def prompt_length(self) -> int:
        return self.prompts.shape[1]

    @property
    def response_length(self) -> int:
        return self.responses.shape[1]

    def __len__(self) -> int:
        return self.prompts.shape[0]

    def rows(self, start: int, stop: int) -> Batch:
        """Rows [start, stop) as a Batch sharing storage (an update chunk or physical batch)."""
        return replace(
            self, **{f.name: t[start:stop] for f in fields(self) if (t := getattr(self, f.name)) is not None}
        )

    def select(self, index: torch.Tensor) -> Batch:
        """The rows at `index` (B',), in that order, as a new Batch (one teacher's samples)."""
        return replace(
            self,
            **{f.name: t.index_select(0, index) for f in fields(self) if (t := getattr(self, f.name)) is not None},
        )

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every filled column, on the CPU and contiguous (for safetensors)."""
        return {f.name: t.detach().cpu().contiguous() for f in fields(self) if (t := getattr(self, f.name)) is not None}


# ---------------------------------------------------------------------- assembly and padding
def left_pad(prompts: list[list[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists -> (ids, mask), both (B, P), left-padded to the longest prompt."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
        mask[i, width - len(p) :] = 1
    return ids.to(device), mask.to(device)


def pad_right(x: torch.Tensor, width: int, value) -> torch.Tensor:
    if x.shape[1] >= width:
        return x[:, :width]
    return torch.nn.functional.pad(x, (0, width - x.shape[1]), value=value)


def with_prompts(batch: Batch, prompts: list[list[int]], pad_id: int) -> Batch:
    """The batch's responses after other prompts (a teacher's own context), one per row: a new
    Batch whose response positions are the original's (the prompts may differ in length)."""
    ids, mask = left_pad(prompts, pad_id, batch.prompts.device)
    return assemble(ids, mask, batch.responses, batch.response_mask, batch.rollout_log_probs, batch.prompt_rows)


def positions_of(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids (B, L) of a left-padded mask (B, L): each row counts from 0 at its first token."""
    return (attention_mask.cumsum(-1) - 1).clamp(min=0)


def assemble(prompts, prompt_mask, responses, response_mask, rollout_log_probs, prompt_rows) -> Batch:
    attention_mask = torch.cat([prompt_mask, response_mask.long()], dim=1)  # (B, L)
    return Batch(
        prompt_rows=prompt_rows,
        prompts=prompts,
        responses=responses,
        input_ids=torch.cat([prompts, responses], dim=1),
        attention_mask=attention_mask,
        position_ids=positions_of(attention_mask),
        response_mask=response_mask,
        rollout_log_probs=rollout_log_probs,
    )
