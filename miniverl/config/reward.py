"""Schema of the `reward` node (verl: reward.*): how a sample's task reward is scored, when
`estimator.use_task_rewards=true`.

By default each row's `data_source` picks one of miniverl's rules (`miniverl.utils.reward_score`,
verl's `default_compute_score` for the sources listed there). A function of the user's own takes
over for every row with `reward.custom_reward_function.path=<file.py>` (and `.name`, default
`compute_score`), called as verl calls it, by keyword: `fn(data_source=..., solution_str=...,
ground_truth=..., extra_info=..., **reward_kwargs)`, returning a float or a dict with a "score".
`extra_info` is the row's (`{}` where it has none) with verl's `num_turns` (2: one prompt, one
response) and `rollout_reward_scores` (`{}`); `reward_kwargs` win over the other arguments, as in verl.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass
class CustomRewardFunctionConfig:
    path: Optional[str] = None  # a Python file; relative paths are taken from the directory the command runs in
    # The function in that file (verl: custom_reward_function.name).
    name: str = "compute_score"
    # Keyword arguments added to every call of that function, over verl's own (verl:
    # custom_reward_function.reward_kwargs), e.g. +reward.custom_reward_function.reward_kwargs.format_score=0.1
    reward_kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class RewardConfig:
    # A reward function of your own (verl: reward.custom_reward_function); null path: the rule of each row's
    # data_source.
    custom_reward_function: CustomRewardFunctionConfig = field(default_factory=CustomRewardFunctionConfig)

    def __post_init__(self) -> None:
        fn = self.custom_reward_function
        if fn.path is not None and not fn.name:
            raise ValueError(
                "reward.custom_reward_function.name must name the function in reward.custom_reward_function.path"
            )
