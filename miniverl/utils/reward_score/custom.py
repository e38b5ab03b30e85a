"""A reward function of the user's own (verl: reward.custom_reward_function): loaded from a Python
file, called by keyword as verl's reward manager calls it, with `reward_kwargs` merged in."""

from __future__ import annotations

import asyncio
import importlib.util
import inspect
import math
import traceback
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from miniverl.utils.errors import MiniverlError

ScoreFn = Callable[..., Any]  # (data_source, solution_str, ground_truth, extra_info) -> float | {"score": ...}

# What verl's reward loop adds to every row's extra_info (verl/experimental/reward_loop/reward_manager/
# naive.py): the rollout's turn count (`__num_turns__`: its single-turn agent loop counts the prompt and
# the response, 2) and the scores a rollout may carry (`reward_scores`: none without tools, {}).
SINGLE_TURN_NUM_TURNS = 2


def reward_extra_info(row_extra_info: Mapping | None) -> dict:
    """The extra_info a scorer receives for a single-turn sample: a copy of the row's (`{}` where the
    row has none) with verl's `num_turns` and `rollout_reward_scores`."""
    return {**(row_extra_info or {}), "num_turns": SINGLE_TURN_NUM_TURNS, "rollout_reward_scores": {}}


def where_in(error: BaseException, file: Path) -> str:
    """`<file> line <n>`: the deepest frame of `error` in the user's `file` ('' when none is)."""
    if isinstance(error, SyntaxError) and error.lineno is not None:
        return f" ({file.name} line {error.lineno})"
    lines = [f.lineno for f in traceback.extract_tb(error.__traceback__) if Path(f.filename) == file.resolve()]
    return f" ({file.name} line {lines[-1]})" if lines else ""


def load_custom_reward_function(path: str, name: str, reward_kwargs: Mapping[str, Any] | None = None) -> ScoreFn:
    """`name` from the Python file `path` (verl: reward.custom_reward_function), to be called by
    keyword as verl calls it: `reward_kwargs` are merged into every call and win over the call's
    own arguments (verl's `_call_with_kwargs`); an `async def` is run to completion. Or one line
    saying what is wrong."""
    where = "reward.custom_reward_function"
    file = Path(path)
    if not file.is_file():
        relative = "" if file.is_absolute() else f" (paths are relative to {Path.cwd()})"
        raise MiniverlError(f"{where}.path={path}: no such file{relative}")
    spec = importlib.util.spec_from_file_location(f"miniverl_custom_reward_{file.stem}", file)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as error:  # the user's file: where it failed, in one line (the chain for HYDRA_FULL_ERROR)
        raise MiniverlError(
            f"{where}.path={path} failed to import: {type(error).__name__}: {error}{where_in(error, file)}"
        ) from error
    fn = getattr(module, name, None)
    if not callable(fn):
        found = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        raise MiniverlError(
            f"{where}.name={name}: {path} defines no function {name!r} (it has: {', '.join(found) or 'none'})"
        )
    fixed = dict(reward_kwargs or {})
    if inspect.iscoroutinefunction(fn):
        return lambda **kwargs: asyncio.run(fn(**{**kwargs, **fixed}))
    return lambda **kwargs: fn(**{**kwargs, **fixed})


def score_value(result: Any) -> float:
    """A scorer's result as a float: a number, or a dict's "score" (verl's reward manager); a
    ValueError saying what came back otherwise."""
    value = result.get("score") if isinstance(result, dict) else result
    if isinstance(value, (str, bytes)):  # float("1") would take it; verl's reward tensor takes no text
        raise ValueError(f"returned {result!r:.80}: return a number or a dict with a 'score', not text")
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"returned {result!r:.80}: return a number or a dict with a 'score'") from None
    if not math.isfinite(number):  # it would reach every advantage of its group, and the loss, as NaN
        raise ValueError(f"returned {result!r:.80}: a task reward must be a finite number")
    return number
