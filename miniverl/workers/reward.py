"""Reward role (verl: `compute_reward`, its naive reward manager): the task reward of each sample.

Each response is decoded up to its last response token with special tokens skipped, scored
against its row's `reward_model.ground_truth` by the rule of its `data_source` (or the user's
`reward.custom_reward_function`), and the score is placed at the sample's last response token
(`token_level_scores`, (B, R)), as verl places it. Runs on the CPU: no model is involved.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path

import torch

from miniverl.config.reward import RewardConfig
from miniverl.protocol import Batch
from miniverl.utils.dataset import PromptSet, TaskRow
from miniverl.utils.errors import MiniverlError
from miniverl.utils.reward_score import (
    RULES,
    ScoreFn,
    default_compute_score,
    load_custom_reward_function,
    score_value,
    where_in,
)


class RewardFailed(Exception):
    """The user's reward function raised, or returned no number: the update is not applied."""


class RewardWorker:
    def __init__(self, tokenizer, prompts: PromptSet, reward: RewardConfig):
        """Checks every kept row before any model loads: a row the reward cannot score is one line."""
        custom = reward.custom_reward_function
        self.compute_score: ScoreFn = (
            load_custom_reward_function(custom.path, custom.name) if custom.path else default_compute_score
        )
        self.scorer = f"{custom.name} of {custom.path}" if custom.path else "miniverl's rules"
        self.file = Path(custom.path) if custom.path else None
        self.tokenizer = tokenizer
        self.tasks = prompts.tasks
        if custom.path is None:
            check_rule_rows(prompts.rows, prompts.tasks)

    def compute_reward(self, batch: Batch) -> Batch:
        """Fills token_level_scores (B, R) float32."""
        lengths = batch.response_mask.sum(-1).long().tolist()  # (B,)
        scores = torch.zeros(batch.responses.shape, dtype=torch.float32)  # (B, R)
        for i, (row, length) in enumerate(zip(batch.prompt_rows.tolist(), lengths)):
            task = self.tasks[row]
            text = self.tokenizer.decode(batch.responses[i, :length].tolist(), skip_special_tokens=True)
            try:  # by keyword, as verl's reward manager calls it
                result = self.compute_score(
                    data_source=task.data_source,
                    solution_str=text,
                    ground_truth=task.ground_truth,
                    extra_info=task.extra_info,
                )
                score = score_value(result)
            except Exception as error:  # the user's function: what, where and on what, in one line
                location = where_in(error, self.file) if self.file else ""
                raise RewardFailed(
                    f"the task reward ({self.scorer}) {type(error).__name__}: {error}{location} on row {row} "
                    f"(data_source {task.data_source!r}, response {text[:40]!r}); fix it and rerun the same "
                    "command"
                ) from error
            scores[i, max(length, 1) - 1] = score
        batch.token_level_scores = scores.to(batch.responses.device)
        return batch


def check_rule_rows(rows: Iterable[int], tasks: Mapping[int, TaskRow]) -> None:
    """Every row has a data_source with a rule and a ground truth, or one line naming the row."""
    for row in rows:
        task = tasks.get(row)
        source = task.data_source if task else None
        if source not in RULES:
            raise MiniverlError(
                f"data.train_files row {row}: no task-reward rule for data_source {source!r} (rules: "
                f"{', '.join(RULES)}); set reward.custom_reward_function.path=<file.py> to score it, or "
                "estimator.use_task_rewards=false"
            )
        if task.ground_truth is None:
            raise MiniverlError(
                f"data.train_files row {row}: no reward_model.ground_truth for the {source} rule; add it, "
                "or set estimator.use_task_rewards=false"
            )
        if not isinstance(task.ground_truth, str):  # verl's rules compare strings: 5 != "5" scores 0 there
            raise MiniverlError(
                f"data.train_files row {row}: reward_model.ground_truth is {task.ground_truth!r:.40} "
                f"({type(task.ground_truth).__name__}); the {source} rule compares strings, as verl's does: "
                "store it as a string, or score it with reward.custom_reward_function.path"
            )
