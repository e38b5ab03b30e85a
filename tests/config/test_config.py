"""Composition: every option of every group composes, the recipe holds the reference values,
the command line wins over the recipe, and typos or wrong types fail at composition."""

from __future__ import annotations

import pytest
from hydra.errors import ConfigCompositionException

from miniverl.config import MiniverlConfig, to_config
from miniverl.utils.errors import MiniverlError

from conftest import CONF, compose_config

GROUPS = ["model", "teacher", "estimator", "hardware", "data", "trainer"]
OPTIONS = [(group, path.stem) for group in GROUPS for path in sorted((CONF / group).glob("*.yaml"))]


def test_required_options_exist():
    names = {f"{g}/{o}" for g, o in OPTIONS}
    for required in (
        "model/qwen3_0_6b",
        "model/toy",
        "teacher/qwen3_1_7b",
        "teacher/toy",
        "estimator/k1",
        "hardware/auto",
        "hardware/cpu",
        "hardware/rtx4080_16gb",
    ):
        assert required in names


@pytest.mark.parametrize("group,option", OPTIONS)
@pytest.mark.slow
def test_every_group_option_composes_and_validates(group, option):
    cfg = compose_config([f"{group}={option}"])
    assert isinstance(to_config(cfg), MiniverlConfig)
    cfg = compose_config(["+recipe=opd_k1", f"{group}={option}"])
    assert isinstance(to_config(cfg), MiniverlConfig)


def test_recipe_holds_the_reference_values():
    config = to_config(compose_config(["+recipe=opd_k1"]))
    r = config.recipe
    assert (r.logical_batch, r.optimizer_updates, r.interrupt_after_updates, r.prompt_limit, r.response_limit) == (
        4,
        8,
        4,
        128,
        64,
    )
    assert config.estimator.teacher_target == "sampled_token_log_probability"
    assert config.estimator.loss_mode == "k1" and config.estimator.use_policy_gradient
    assert config.estimator.policy_loss_mode == "vanilla"
    lora = config.model.lora
    assert (lora.r, lora.alpha, lora.dropout, list(lora.target_modules)) == (16, 32, 0.0, ["q_proj", "v_proj"])
    assert config.model.quantization == config.teacher.quantization == "nf4"
    assert config.model.gradient_checkpointing and config.model.attn_implementation == "sdpa"
    assert config.model.model_id == "Qwen/Qwen3-0.6B"
    assert config.model.revision == "c1899de289a04d12100db370d81485cdf75e47ca"
    assert config.teacher.model_id == "Qwen/Qwen3-1.7B"
    assert config.teacher.revision == "70d244cc86ccca08cf5af4e1e306ecf908b1ad5e"


def test_lora_targets_are_a_list_of_layer_names_or_verls_all_linear():
    lora = to_config(compose_config(["+recipe=opd_k1", "model.lora.target_modules=all-linear"])).model.lora
    assert lora.peft_targets() == "all-linear" and lora.describe_targets() == "all-linear"
    lora = to_config(compose_config(["+recipe=opd_k1", "model.lora.target_modules=[q_proj,o_proj]"])).model.lora
    assert lora.peft_targets() == ["q_proj", "o_proj"] and type(lora.target_modules) is list
    assert lora.describe_targets() == "q_proj, o_proj"


def test_command_line_choices_and_values_win_over_the_recipe():
    config = to_config(compose_config(["+recipe=opd_k1", "model=toy", "teacher=toy", "recipe.logical_batch=2"]))
    assert config.model.model_id == "toy" and config.teacher.model_id == "toy"
    assert config.recipe.logical_batch == 2
    assert config.model.lora.r == 16  # the recipe's LoRA still applies to the chosen model


def test_model_and_teacher_fields_are_the_reference_report_fields(reference_report):
    import dataclasses

    config = to_config(compose_config(["+recipe=opd_k1"]))
    assert set(dataclasses.asdict(config.model)) == set(reference_report["models"]["student"])
    # Plus the routing key of several teachers (verl's teacher_models.<name>.key), which the single
    # teacher does not read and the report's models.teacher block leaves out, the privileged
    # context and the alignment of a teacher with another tokenizer (miniverl's).
    added = {"key", "context", "tokenizer_alignment", "alignment_credit", "unwritable_byte_log_prob"}
    assert set(dataclasses.asdict(config.teacher)) == set(reference_report["models"]["teacher"]) | added


@pytest.fixture
def reference_report():
    import json

    from conftest import ROOT

    return json.loads((ROOT / "recipes" / "opd_k1" / "reference-report-rtx4080.json").read_text())


@pytest.mark.parametrize("override", ["recipe.logical_btch=2", "model.lora.rank=8", "estimator.clip_ratoi=0.1"])
def test_a_typo_in_an_override_fails_at_composition(override):
    with pytest.raises(ConfigCompositionException) as info:
        compose_config(["+recipe=opd_k1", override])
    key = override.split("=")[0].split(".")[-1]
    assert f"Key '{key}' not in" in str(info.value.__cause__)


@pytest.mark.parametrize(
    "forced,line",
    [
        (
            "+recipe.logical_btch=2",
            "unknown config key recipe.logical_btch: the schema (the recipe node) has no such key; "
            "did you mean recipe.logical_batch?",
        ),
        (
            "+foo=1",
            "unknown config key foo: the schema (the top level) has no such key; the top level has model, teacher, "
            "teachers, teacher_key, default_teacher, estimator, hardware, data, trainer, actor, rollout, algorithm, "
            "reward, recipe, export, eval",
        ),
        # Another program's name no spelling distance finds (peft's and verl's rank)
        (
            "+model.lora.rank=8",
            "unknown config key model.lora.rank: the schema (the model.lora node) has no such key; "
            "did you mean model.lora.r?",
        ),
    ],
)
def test_a_key_forced_in_with_plus_is_refused_with_the_closest_key(forced, line):
    with pytest.raises(MiniverlError) as refused:
        to_config(compose_config(["+recipe=opd_k1", forced]))
    assert str(refused.value) == line


def test_an_unknown_group_option_fails_at_composition():
    with pytest.raises(ConfigCompositionException, match="estimator"):
        compose_config(["estimator=k9"])


def test_a_wrong_type_fails_at_composition():
    with pytest.raises(ConfigCompositionException):
        compose_config(["recipe.logical_batch=four"])


@pytest.mark.parametrize(
    "override,message",
    [
        ("recipe.logical_batch=0", "recipe.logical_batch=0 must be >= 1"),
        ("model.quantization=int3", "model.quantization='int3'"),
        ("hardware.device=tpu", "hardware.device='tpu'"),
        ("recipe.interrupt_after_updates=0", "recipe.interrupt_after_updates=0 must be >= 1"),
        ("model.lora.target_modules=all_linear", "model.lora.target_modules='all_linear'; give a list"),
        ("model.lora.target_modules=[]", "model.lora.target_modules=[]; give a list of layer names"),
        ("trainer.logger=[console,file]", "wandb (verl's file logger is miniverl's jsonl)"),
        # A new-user audit: these were tracebacks ("'NoneType' object is not iterable"), exit 1.
        ("data.train_files=null", "data.train_files must be a parquet path or a non-empty list of paths, not None"),
        ("data.train_files=2024", "data.train_files must be a parquet path or a non-empty list of paths, not 2024"),
        ("data.val_files=123", "data.val_files must be a parquet path, a list of paths or null, not 123"),
        ("data.val_files=[a.parquet,null]", "data.val_files must be a parquet path, a list of paths or null, not ['a"),
    ],
)
def test_a_refused_value_is_one_line_naming_the_key(override, message):
    with pytest.raises(MiniverlError) as info:
        to_config(compose_config(["+recipe=opd_k1", override]))
    assert message in str(info.value) and "\n" not in str(info.value)


def test_the_cpu_prepack_asked_for_with_the_compiled_decode_is_refused_not_ignored():
    """A new-user audit set both: the prepack was silently not applied (reordered_layers 0), plan.json said true."""
    both = ["+recipe=opd_k1", "hardware.rollout_cpu_prepack=true", "hardware.rollout_compile=true"]
    with pytest.raises(
        MiniverlError, match="hardware.rollout_cpu_prepack=true does not apply with hardware.rollout_co"
    ):
        to_config(compose_config(both))
    to_config(compose_config(["+recipe=opd_k1", "hardware.rollout_compile=true"]))  # by the CPU: off when compiling


# Every numeric knob a user can get wrong, with a value its range refuses (issue: `lr=-1e-4` used to
# reach torch's optimizer, after plan.json, toy_models/ and trajectories/ were written).
OUT_OF_RANGE = [
    ("actor.optim.lr=-1e-4", "actor.optim.lr=-0.0001 must be > 0: AdamW's step size"),
    ("actor.optim.lr=0", "actor.optim.lr=0.0 must be > 0"),
    ("actor.optim.lr=nan", "actor.optim.lr=nan must be a finite number > 0"),
    ("actor.optim.eps=0", "actor.optim.eps=0.0 must be > 0"),
    ("actor.optim.weight_decay=-0.1", "actor.optim.weight_decay=-0.1 must be >= 0"),
    ("actor.optim.betas=[0.9,1.0]", "actor.optim.betas[1]=1.0 must be >= 0 and < 1"),
    ("actor.grad_clip=0", "actor.grad_clip=0.0 must be > 0"),
    ("actor.clip_ratio_low=1.5", "actor.clip_ratio_low=1.5 must be > 0 and < 1 (or null)"),
    ("estimator.clip_ratio_high=-0.2", "estimator.clip_ratio_high=-0.2 must be > 0 (or null)"),
    ("estimator.loss_max_clamp=0", "estimator.loss_max_clamp=0.0 must be > 0 (or null)"),
    ("estimator.log_prob_min_clamp=5", "estimator.log_prob_min_clamp=5.0 must be < 0 (or null)"),
    ("estimator.topk=0", "estimator.topk=0 must be >= 1 (or null)"),
    ("rollout.temperature=0", "rollout.temperature=0.0 must be > 0: sampling is always on in OPD"),
    ("rollout.top_p=1.5", "rollout.top_p=1.5 must be > 0 and <= 1"),
    ("rollout.top_k=-2", "rollout.top_k=-2 must be >= -1"),
    ("model.lora.alpha=0", "model.lora.alpha=0 must be > 0"),
    ("model.lora.dropout=1", "model.lora.dropout=1.0 must be >= 0 and < 1"),
    ("model.toy.num_layers=0", "model.toy.num_layers=0 must be >= 1"),
    ("teacher.toy.num_heads=0", "teacher.toy.num_heads=0 must be >= 1"),
    ("teacher.toy_pretrain_lr=-1", "teacher.toy_pretrain_lr=-1.0 must be > 0"),
    ("eval.exact_kl_max_vocab=0", "eval.exact_kl_max_vocab=0 must be >= 1"),
    ("hardware.peak_reserved_limit_gib=0", "hardware.peak_reserved_limit_gib=0.0 must be > 0 (or null)"),
    ("recipe.response_limit=0", "recipe.response_limit=0 must be >= 1"),
]


@pytest.mark.parametrize("override,message", OUT_OF_RANGE)
@pytest.mark.slow
def test_every_numeric_knob_out_of_its_range_is_refused_when_composed(override, message):
    with pytest.raises(MiniverlError) as info:
        to_config(compose_config(["+recipe=opd_k1", "model=toy", "teacher=toy", override]))
    assert str(info.value).startswith(message) and "\n" not in str(info.value)


@pytest.mark.parametrize(
    "overrides,after,note",
    [
        ([], 4, None),
        (["recipe.optimizer_updates=3"], 1, "resume check after update 1: recipe.interrupt_after_updates=4"),
        (["recipe.optimizer_updates=4"], 2, "is not before recipe.optimizer_updates=4"),
        (["recipe.optimizer_updates=1"], None, "resume check skipped: recipe.optimizer_updates=1"),
        (["recipe.interrupt_after_updates=null"], None, None),
    ],
)
def test_fewer_updates_than_the_preset_adapt_the_resume_check(overrides, after, note):
    recipe = to_config(compose_config(["+recipe=opd_k1", *overrides])).recipe
    assert recipe.resume_check_after == after
    assert (recipe.resume_check_note is None) if note is None else note in recipe.resume_check_note


TWO_TEACHERS = ["+recipe=opd_k1", "+teacher@teachers.a=toy", "+teacher@teachers.b=toy", "teachers.a.key=x"]


def test_several_teachers_compose_each_from_a_teacher_option():
    config = to_config(compose_config([*TWO_TEACHERS, "teachers.b.key=y", "+teacher@teachers.c=toy_qwen3",
                                       "teachers.c.key=z", "teachers.c.mode=ref"]))  # fmt: skip
    assert list(config.teacher_blocks) == ["a", "b", "c"] and config.teacher_key == "data_source"
    assert config.teachers["c"].toy.tokenizer == "qwen3" and config.teachers["c"].mode == "ref"
    assert list(to_config(compose_config(["+recipe=opd_k1"])).teacher_blocks) == ["teacher"]


@pytest.mark.parametrize(
    "extra,message",
    [
        ([], "teachers.b.key is not set: give the data_source value it scores (teachers.b.key=<value>)"),
        (["teachers.b.key=x"], "teachers.a and teachers.b both have key='x'"),
        (["teachers.b.key=y", "teachers.b.mode=bogus"], "teachers.b.mode='bogus'; choose one of"),
        (["teachers.b.key=y", "teachers.b.mode=shared_base"], "teachers.b.mode=shared_base needs teachers.b.adapter="),
        (["teachers.b.key=y", "default_teacher=c"], "default_teacher='c' is not one of teachers: a, b"),
        (["teachers.b.key=y", "teacher_key=''"], "teacher_key is empty"),
        (
            [
                "teachers.b.key=y",
                "teachers.a.mode=shared_base",
                "teachers.a.adapter=A",
                "teachers.b.mode=shared_base",
                "teachers.b.adapter=B",
            ],  # fmt: skip
            "teachers a, b are all mode=shared_base",
        ),
    ],
)
@pytest.mark.slow
def test_a_refused_teachers_setting_is_one_line_naming_it(extra, message):
    with pytest.raises(MiniverlError) as info:
        to_config(compose_config([*TWO_TEACHERS, *extra]))
    assert message in str(info.value) and "\n" not in str(info.value)


def test_one_entry_in_teachers_is_accepted_as_verl_accepts_it_and_a_default_without_teachers_is_refused():
    cfg = to_config(compose_config(["+recipe=opd_k1", "+teacher@teachers.a=toy", "teachers.a.key=x"]))
    assert list(cfg.teacher_blocks) == ["a"] and not cfg.routed  # one teacher: it scores every row
    with pytest.raises(MiniverlError, match=r"teachers.a.key is not set"):
        to_config(compose_config(["+recipe=opd_k1", "+teacher@teachers.a=toy"]))  # verl requires it too
    with pytest.raises(MiniverlError, match="default_teacher='a' names no teacher"):
        to_config(compose_config(["+recipe=opd_k1", "default_teacher=a"]))


@pytest.mark.parametrize(
    "loss_mode,target,topk,full_vocab",
    [
        ("k1", "sampled_token_log_probability", False, False),
        ("k3", "sampled_token_log_probability", False, False),
        ("forward_kl_topk", "top_k_log_probabilities", True, False),
        ("forward_kl_topk_tail", "top_k_log_probabilities", True, False),
        ("reverse_kl_full", "full_vocabulary_log_probabilities", False, True),
        ("reverse_kl_topk", "full_vocabulary_log_probabilities", False, True),  # at the student's top-k
    ],
)
def test_what_the_teacher_returns_follows_the_loss(loss_mode, target, topk, full_vocab):
    from miniverl.config.estimator import EstimatorConfig

    estimator = EstimatorConfig(loss_mode=loss_mode, use_policy_gradient=loss_mode in ("k1", "k3"))
    assert (estimator.teacher_target, estimator.uses_topk, estimator.uses_full_vocab) == (target, topk, full_vocab)
