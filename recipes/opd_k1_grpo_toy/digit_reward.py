"""An example of a task reward of your own (reward.custom_reward_function.path=<this file>):

    python -m miniverl.main +recipe=opd_k1_grpo_toy \\
        reward.custom_reward_function.path=recipes/opd_k1_grpo_toy/digit_reward.py

Called as verl calls it, once per sample, by keyword; returns a number or a dict with a "score" (the other
keys are verl's reward_extra_info, not used by miniverl). Here: 1 for an answer that is exactly
the ground truth, 0.1 for one that holds a digit at all (a shaped reward), else 0.
"""

import re


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    answer = solution_str.strip()
    if answer == ground_truth:
        return {"score": 1.0, "exact": True}
    return {"score": 0.1 if re.search(r"\d", answer) else 0.0, "exact": False}
