"""Reward role (verl: `compute_reward`, its naive reward manager): the task reward of each sample.

Each response is decoded up to its last response token with special tokens skipped, scored
against its row's `reward_model.ground_truth` by the rule of its `data_source` (or the user's
`reward.custom_reward_function`), and the score is placed at the sample's last response token
(`token_level_scores`, (B, R)), as verl places it. The scorer is called by keyword as verl's
reward manager calls it: `data_source`, `solution_str`, `ground_truth` and `extra_info` (the row's,
`{}` where it has none, plus verl's `num_turns` and `rollout_reward_scores`), and for the user's
function `reward.custom_reward_function.reward_kwargs` on top. Runs on the CPU: no model is involved.
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
    NOT_COVERED,
    ScoreFn,
    default_compute_score,
    load_custom_reward_function,
    reward_extra_info,
    rule_for,
    rule_names,
    score_value,
    where_in,
)


class RewardFailed(Exception):
    """The user's reward function raised, or returned no number: the update is not applied. `file`:
    the function's file (None for a built-in rule), which the run's plan holds the digest of."""

    def __init__(self, message: str, file: Path | None):
        super().__init__(message)
        self.file = file


class RewardWorker:
    def __init__(self, tokenizer, prompts: PromptSet, reward: RewardConfig):
        """Checks every kept row before any model loads: a row the reward cannot score is one line."""
        custom = reward.custom_reward_function
        self.compute_score: ScoreFn = (
            load_custom_reward_function(custom.path, custom.name, custom.reward_kwargs)
            if custom.path
            else default_compute_score
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
                    extra_info=reward_extra_info(task.extra_info),
                )
                score = score_value(result)
            except Exception as error:  # the user's function: what, where and on what, in one line
                location = where_in(error, self.file) if self.file else ""
                fix = (  # a resume refuses the fixed file
                    "fix it and start a new run (the function's file is part of the plan: without hydra.run.dir "
                    "the same command makes a new folder; with it, choose another or add trainer.overwrite=true)"
                    if self.file
                    else "fix it and rerun the same command"
                )
                raise RewardFailed(
                    f"the task reward ({self.scorer}) {type(error).__name__}: {error}{location} on row {row} "
                    f"(data_source {task.data_source!r}, response {text[:40]!r}); {fix}",
                    self.file,
                ) from error
            scores[i, max(length, 1) - 1] = score
        batch.token_level_scores = scores.to(batch.responses.device)
        return batch


def check_rule_rows(rows: Iterable[int], tasks: Mapping[int, TaskRow]) -> None:
    """Every row has a data_source with a rule and the ground truth that rule reads, or one line
    naming the row."""
    for row in rows:
        task = tasks.get(row)
        source = task.data_source if task else None
        rule = rule_for(source)
        if rule is None:
            why = f" ({NOT_COVERED[source]})" if source in NOT_COVERED else ""
            raise MiniverlError(
                f"data.train_files row {row}: no task-reward rule for data_source {source!r}{why} (rules: "
                f"{rule_names()}); set reward.custom_reward_function.path=<file.py> to score it, or "
                "estimator.use_task_rewards=false"
            )
        truth = task.ground_truth
        if truth is None:
            raise MiniverlError(
                f"data.train_files row {row}: no reward_model.ground_truth for the {source} rule; add it, "
                "or set estimator.use_task_rewards=false"
            )
        if rule.truth == "text" and not isinstance(truth, str):  # verl's rules compare strings: 5 != "5"
            raise MiniverlError(
                f"data.train_files row {row}: reward_model.ground_truth is {truth!r:.40} "
                f"({type(truth).__name__}); the {source} rule compares strings, as verl's does: "
                "store it as a string, or score it with reward.custom_reward_function.path"
            )
        if rule.truth == "targets" and not _has_targets(truth):
            raise MiniverlError(
                f"data.train_files row {row}: reward_model.ground_truth is {truth!r:.40}; the {source} rule "
                "reads {'target': <answer or list of answers>}, as verl's Search-R1 data holds it"
            )


def _has_targets(truth) -> bool:
    if not isinstance(truth, Mapping) or "target" not in truth:
        return False
    targets = truth["target"]
    return isinstance(targets, str) or (
        not isinstance(targets, Mapping) and hasattr(targets, "__iter__") and all(isinstance(t, str) for t in targets)
    )
