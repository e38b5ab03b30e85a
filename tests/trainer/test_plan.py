"""The plan's prompt order is verl's: the rows each update takes are the batches verl's train dataloader
yields pass after pass (its sampler and drop_last), checked against goldens that verl's own
create_rl_sampler made (scripts/make_prompt_order_goldens.py; tests/data/verl-<version>-prompt-order.json)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from miniverl.config import to_config
from miniverl.models.toy import build_toy_tokenizer
from miniverl.trainer.plan import compile_plan, prompt_order
from miniverl.utils.dataset import read_conversations, tokenize_prompts

from conftest import DATA, SHORT, compose_config


def golden_cases():
    for version in ("0.8.0", "0.9.1"):
        for case in json.loads((DATA / f"verl-{version}-prompt-order.json").read_text())["cases"]:
            yield pytest.param(case, id=f"{version}-rows{case['rows']}-batch{case['train_batch_size']}-"
                               f"{'seed' + str(case['seed']) if case['shuffle'] else 'file-order'}")  # fmt: skip


@pytest.mark.parametrize("case", list(golden_cases()))
def test_each_update_takes_the_batch_verls_dataloader_yields_at_that_step(case):
    """Shuffled with a seed, with verl's default seed (null: torch's default generator), in file order; the
    prompts dividing into batches or leaving a partial one, which verl drops at every pass."""
    rows, batch = case["rows"], case["train_batch_size"]
    seed = "null" if case["seed"] is None else case["seed"]
    overrides = [f"recipe.logical_batch={batch}", f"data.shuffle={case['shuffle']}", f"data.seed={seed}"]
    config = to_config(compose_config(["+recipe=opd_k1", *SHORT, *overrides]))
    verl_steps = [step for epoch in case["epochs"] for step in epoch]
    kept = SimpleNamespace(rows=tuple(range(100, 100 + rows)))  # parquet rows kept: a dataset index is a position
    order = prompt_order(kept, config, batch * len(verl_steps))
    assert [order[i : i + batch] for i in range(0, len(order), batch)] == [
        [100 + index for index in step] for step in verl_steps
    ]


def test_a_pass_that_leaves_a_partial_batch_drops_it_and_the_next_update_starts_the_next_pass():
    """64 toy prompts in batches of 10: six whole batches a pass, rows 60-63 never taken (verl's drop_last),
    update 7 the next pass's first batch, which training/epoch counts from 0."""
    overrides = ["recipe.logical_batch=10", "recipe.optimizer_updates=13", "data.repeat_prompts=true"]
    config = to_config(compose_config(["+recipe=opd_k1", *SHORT, *overrides]))
    prompts = tokenize_prompts(read_conversations(config.data), config.data, build_toy_tokenizer(), 128)
    plan = compile_plan(config, prompts)
    assert len(prompts) == 64 and plan.updates[5].prompt_rows == tuple(range(50, 60))
    assert plan.updates[6].prompt_rows == tuple(range(10)) and plan.updates[12].prompt_rows == tuple(range(10))
    assert [plan.epoch_of(u) for u in (1, 6, 7, 12, 13)] == [0, 0, 1, 1, 2]
