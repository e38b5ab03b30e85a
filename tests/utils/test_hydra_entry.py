"""Hydra's composition errors as miniverl's one line: Hydra's wording kept, the noise dropped, the fix added."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hydra.errors import ConfigCompositionException, OverrideParseException
from omegaconf import OmegaConf

from miniverl.utils.hydra_entry import hydra_error_line
from miniverl.utils.sweeps import numbered_jobs
from miniverl.verl_compat.field_rules import verl_key_hints

from conftest import compose_config


def _line_of(*overrides: str) -> str:
    with pytest.raises((ConfigCompositionException, OverrideParseException)) as info:
        compose_config(["+recipe=opd_k1", *overrides])
    return hydra_error_line(info.value)


def test_a_misspelt_key_names_the_closest_key_of_its_node():
    line = _line_of("model.lora.rr=3")
    assert line == "Could not override 'model.lora.rr'; Key 'rr' not in 'LoraSettings'; did you mean model.lora.r?"


def test_a_key_under_another_programs_name_is_given_miniverls_and_a_key_several_fields_map_is_not():
    from miniverl.verl_compat.field_rules import miniverl_names

    names = miniverl_names()
    assert names["data.train_batch_size"] == "recipe.logical_batch" and "data.train_files" not in names  # same name
    assert "actor_rollout_ref.rollout.max_model_len" not in names  # both prompt_limit and response_limit hold it
    with pytest.raises(ConfigCompositionException) as info:
        compose_config(["+recipe=opd_k1", "data.train_batch_size=4"])
    assert hydra_error_line(info.value, verl_key_hints).endswith(
        "data.train_batch_size is verl's name: miniverl's is recipe.logical_batch"
    )
    assert hydra_error_line(info.value).endswith(  # without verl's hints: the node's keys
        "data has train_files, val_files, prompt_key, filter_overlong_prompts, shuffle, repeat_prompts, "
        "apply_chat_template_kwargs, seed"
    )


@pytest.mark.parametrize(
    ("override", "fix"),
    [
        # A new-user audit: verl's keys miniverl has no field for got the generic fix, and total_epochs was
        # sent to the update count alone.
        ("data.truncation=left", "data.truncation is verl's: an overlong prompt is an error, or with"),
        ("trainer.total_epochs=1", "trainer.total_epochs is verl's: miniverl counts optimizer updates, not passes"),
        ("actor_rollout_ref.actor.ppo_epochs=2", "actor_rollout_ref.actor.ppo_epochs is verl's: one epoch per batch"),
    ],
)
def test_a_verl_key_miniverl_has_no_field_for_says_why_or_where_it_went(override, fix):
    with pytest.raises(ConfigCompositionException) as info:
        compose_config(["+recipe=opd_k1", override])
    assert fix in hydra_error_line(info.value, verl_key_hints)


def test_a_verl_key_forced_in_with_a_plus_gets_the_same_hint(tmp_path, capsys):
    """`+data.max_prompt_length=64` composes (the + adds the key) and the schema refuses it in to_config:
    that line said only "unknown config key"; without the + the hint named recipe.prompt_limit."""
    from conftest import run_as_command

    status = run_as_command(
        "main", "+recipe=opd_k1", "model=toy", "teacher=toy", "+data.max_prompt_length=64", f"hydra.run.dir={tmp_path}"
    )
    assert status == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "miniverl: error: unknown config key data.max_prompt_length: the schema (the data node) has no such key; "
        "data.max_prompt_length is verl's name: miniverl's is recipe.prompt_limit"
    )


def test_an_unknown_top_level_key_lists_the_top_level():
    assert _line_of("foo=3").endswith(
        "Key 'foo' not in 'MiniverlConfig'; the top level has model, teacher, teachers, teacher_key, "
        "default_teacher, estimator, hardware, data, trainer, actor, rollout, algorithm, reward, recipe, export, eval"
    )


@pytest.mark.parametrize(
    ("override", "fix"),
    [
        ("model.lora.rank=8", "did you mean model.lora.r?"),  # peft's and verl's name, no spelling distance away
        ("actor.optim.learning_rate=1e-5", "did you mean actor.optim.lr?"),  # transformers' Trainer
        ("rollout.max_new_tokens=32", "did you mean recipe.response_limit?"),  # generate's
        ("data.batch_size=4", "did you mean recipe.logical_batch?"),
        ("teacher.model_name_or_path=x", "did you mean teacher.model_id?"),  # TRL's name, under the node typed
        ("eval.max_new_tokens=8", "did you mean eval.response_limit?"),
        ("model.lora.lora_alpha=8", "did you mean model.lora.alpha?"),  # a spelling distance decides first
        # nothing close, no other program's name: the node's keys
        ("model.lora.scale=2", "model.lora has r, alpha, dropout, target_modules, bias"),
    ],
)
def test_an_unknown_key_gets_miniverls_key_for_another_programs_name_or_its_nodes_keys(override, fix):
    assert _line_of(override).endswith(fix)


def test_a_wrong_type_keeps_hydras_wording_and_names_the_schema():
    line = _line_of("recipe.logical_batch=four")
    assert line.startswith("Error merging override recipe.logical_batch=four; Value 'four' of type 'str'")
    assert "miniverl/config/" in line and "\n" not in line


def test_a_missing_option_lists_the_groups_options_without_the_search_path():
    line = _line_of("estimator=k9")
    assert line.startswith("In 'config': Could not find 'estimator/k9'; Available options in 'estimator': abs, ")
    assert "provider=" not in line and "\n" not in line


@pytest.mark.parametrize("module", ["main", "doctor", "export"])
def test_the_console_scripts_find_the_config_from_any_folder(module, tmp_path):
    # `miniverl`, `miniverl-doctor`, `miniverl-export` import the module and call its cli().
    code = f"import sys; sys.argv = ['miniverl', 'model=tyo']; from miniverl.{module} import cli; cli()"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip() == (
        "miniverl: error: In 'config': Could not find 'model/tyo'; "
        "Available options in 'model': qwen3_0_6b, smollm2_135m_drop5, smollm2_135m_every2, "
        "smollm2_135m_every2_qwen2_tokenizer, "
        "toy, toy_qwen3"
    )


@pytest.mark.parametrize("command", ["main", "doctor", "export"])
def test_help_opens_with_what_the_command_does(command):
    import importlib

    shown = subprocess.run(
        [sys.executable, "-m", f"miniverl.{command}", "--help"], capture_output=True, text=True, check=True
    ).stdout
    doc = importlib.import_module(f"miniverl.{command}").__doc__.strip()
    assert shown.startswith(doc + "\n") and "powered by Hydra" not in shown
    assert "== Configuration groups ==" in shown  # Hydra's own sections follow


def test_a_list_key_given_one_value_says_to_give_a_list():
    line = _line_of("trainer.logger=console")
    assert "str is not a ListConfig" in line and line.endswith("give one in brackets, key=[value] (key=[a,b] for two)")


def test_a_bare_tilde_in_a_value_says_to_write_the_path_with_home():
    line = _line_of("model.model_id=~/models/x")
    assert line.startswith("LexerNoViableAltException: model.model_id=~/models/x")
    assert line.endswith("write the path with $HOME (the shell expands it)")


def test_a_sweeps_jobs_are_numbered_by_the_order_of_its_swept_keys_not_of_the_others():
    def jobs(*task):
        return numbered_jobs(OmegaConf.create({"overrides": {"task": list(task)}}))

    sweep = jobs("+recipe=opd_k1", "estimator=k1,k3", "model.lora.r=8,16")
    assert sweep[1] == ["+recipe=opd_k1", "estimator=k1", "model.lora.r=16"]
    assert jobs("estimator=k1,k3", "+recipe=opd_k1", "model.lora.r=8,16", "trainer.overwrite=true") == sweep
    assert jobs("+recipe=opd_k1", "model.lora.r=8,16", "estimator=k1,k3") != sweep  # jobs 1 and 2 swap


def test_a_sweeps_jobs_count_its_sweeper_params_and_fall_back_to_its_arguments_where_hydra_numbers_at_random():
    def jobs(task, params=None):
        return numbered_jobs(OmegaConf.create({"overrides": {"task": task}, "sweeper": {"params": params or {}}}))

    assert jobs(["+recipe=opd_k1"], {"estimator": "k1,k3"}) == jobs(["+recipe=opd_k1", "estimator=k1,k3"])
    assert jobs(["b=shuffle(1,2)", "a=1"]) == [["a=1", "b=shuffle(1,2)"]]  # the same arguments, in any order
