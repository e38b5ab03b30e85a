"""The verl v0.8.0 export: every field has a rule, the launch composes against verl's own config tree
(unknown keys and wrong types fail), it passes the checks verl makes only at run time, and
export -> import -> export is a fixed point.

verl 0.8.0 is installed without its dependencies (`pip install --no-deps verl==0.8.0`): only its
config tree (verl/trainer/config, shipped as data) and its source text are read; no verl module is
imported.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf
from verl_oracle import compose_verl, type_errors, verl_dataclasses, verl_tree

from miniverl import import_verl as import_command
from miniverl.config import to_config
from miniverl.utils.errors import MiniverlError
from miniverl.utils.identity import resolved_config, sha256_json
from miniverl.utils.overrides import hydra_value
from miniverl.verl_compat import import_render, import_verl, launch_reader
from miniverl.verl_compat.defaults import DATACLASS_DEFAULTS_THAT_DIFFER, FIXED, LOSS, TEACHER, VERL_DEFAULTS
from miniverl.verl_compat.field_rules import RULES, STATUSES, rule_for, rule_table, rules_for
from miniverl.verl_compat.launch_writer import config_fields, export, field_rule_digest, field_rules
from miniverl.verl_compat.not_imported import REFUSED_WHY
from miniverl.verl_compat.runtime_checks import runtime_violations

from conftest import ROOT, compose_config

RECIPE = ["+recipe=opd_k1", "export.verl_version=0.8.0"]  # verl 0.9.1: test_verl_0_9.py
SCALES = {
    "1_trainer_gpu_plus_1_teacher_gpu": [],
    "2x4_trainer_gpus_plus_2_teacher_replicas_tp2": [
        "export.nnodes=2",
        "export.n_gpus_per_node=4",
        "export.teacher_n_gpus_per_node=4",
        "export.teacher_replicas=2",
        "export.teacher_tensor_parallel_size=2",
        "export.rollout_tensor_parallel_size=2",
        "recipe.logical_batch=32",
        "hardware.update_chunk=2",
    ],
}
# Every knob away from its default: the round trip must carry each of them.
EVERYTHING_CHANGED = [
    "estimator=forward_kl_topk",
    "estimator.topk=16",
    "estimator.loss_max_clamp=null",
    "estimator.clip_ratio_high=0.28",
    "export.nnodes=2",
    "export.n_gpus_per_node=2",
    "export.teacher_nnodes=2",
    "export.teacher_n_gpus_per_node=2",
    "export.teacher_replicas=1",
    "export.teacher_tensor_parallel_size=4",
    "export.rollout_name=sglang",
    "export.rollout_tensor_parallel_size=2",
    "export.use_dynamic_bsz=true",
    "export.max_token_len_per_gpu=4096",
    "export.rollout_gpu_memory_utilization=0.6",
    "export.teacher_gpu_memory_utilization=0.7",
    "recipe.logical_batch=8",
    "recipe.optimizer_updates=20",
    "recipe.prompt_limit=256",
    "recipe.response_limit=512",
    "model.lora.r=8",
    "model.lora.alpha=16",
    "model.lora.target_modules=[q_proj,k_proj,v_proj,o_proj]",
    "model.gradient_checkpointing=false",
    "teacher.dtype=float16",
    "actor.optim.lr=3e-6",
    "actor.optim.eps=1e-6",
    "actor.optim.betas=[0.9,0.95]",
    "actor.grad_clip=0.5",
    "rollout.temperature=0.8",
    "rollout.top_p=0.95",
    "rollout.top_k=50",
    "data.val_files=[data/held_out.parquet]",
    "data.shuffle=true",
    "data.seed=7",
    "data.filter_overlong_prompts=true",
    "+data.apply_chat_template_kwargs.enable_thinking=false",
    "trainer.seed=5",
    "trainer.logger=[console,tensorboard,wandb]",
    "trainer.save_freq=-1",
    "trainer.experiment_name=sweep_a",
    "hardware.deterministic=false",
    "algorithm.rollout_correction.bypass_mode=true",
]


# ---------------------------------------------------------------- verl's config tree, read not imported


@pytest.fixture(scope="session")
def verl_root() -> Path:
    return verl_tree("0.8.0")


@pytest.fixture(scope="session")
def verl_default(verl_root):
    """verl's ppo_trainer config with no override, unresolved, as a plain dict."""
    return OmegaConf.to_container(compose_verl(verl_root, []), resolve=False)


@pytest.fixture(scope="session")
def recipe_lines(tmp_path_factory) -> list[str]:
    """overrides.txt of the opd_k1 recipe at the default scale."""
    return export_lines(tmp_path_factory.mktemp("recipe"), [])


def export_lines(tmp_path: Path, overrides: list[str], name: str = "verl") -> list[str]:
    export(compose_config([*RECIPE, *overrides]), tmp_path / name, cwd=ROOT)
    return (tmp_path / name / "overrides.txt").read_text().splitlines()


def parsed(lines: list[str]) -> dict:
    return {o.key_or_group: o.value() for o in OverridesParser.create().parse_overrides(lines)}


# ---------------------------------------------------------------- every field has a rule


def test_every_field_of_the_resolved_config_has_a_rule():
    configs = [compose_config([*RECIPE, f"estimator={mode}"]) for mode in ("k1", "k3", "forward_kl_topk")]
    configs += [
        compose_config(
            [
                *RECIPE,
                "model=toy",
                "teacher=toy",
                "hardware=cpu",
                "teacher.mode=ref",
                "+data.apply_chat_template_kwargs.enable_thinking=false",
            ]
        ),
        compose_config(["+recipe=opd_k1_two_teachers_toy"]),  # teachers.<name>.*: each teacher's fields
    ]
    seen: set[str] = set()
    for cfg in configs:
        for path in config_fields(cfg):
            rule = rule_for(path)
            assert rule is not None, f"{path} has no verl field rule"
            seen.add(rule.field)
        assert field_rules(cfg) == rule_table()["fields"]
        assert set(config_fields(to_config(cfg))) <= set(config_fields(cfg))  # the typed config walks the same
    stale = {rule.field for rule in RULES} - seen
    assert not stale, f"rules for fields the config does not have: {sorted(stale)}"
    for rule in RULES:
        assert rule.status in STATUSES
        assert rule.note or rule.status in ("mapped", "derived"), f"{rule.field}: say what it means"
        assert bool(rule.verl_keys) == (rule.status in ("mapped", "derived")), rule.field


def test_a_field_without_a_rule_is_refused():
    cfg = compose_config(RECIPE)
    plain = resolved_config(cfg)
    plain["model"]["brand_new_knob"] = 1
    with pytest.raises(MiniverlError, match="no verl field rule for model.brand_new_knob"):
        field_rules(plain)


def test_field_rule_digest_is_the_sha256_of_the_canonical_rule_table(tmp_path):
    export(compose_config(RECIPE), tmp_path / "verl", cwd=ROOT)
    written = json.loads((tmp_path / "verl" / "field_rules.json").read_text())
    digest = field_rule_digest()
    assert digest == sha256_json(rule_table()) == written["field_rule_digest"]
    assert written["rules"] == rule_table()["fields"] and written["fixed"] == rule_table()["fixed"]
    assert len(digest) == 64 and digest == field_rule_digest(json.loads(json.dumps(rule_table())))
    assert field_rule_digest(to_config(compose_config([*RECIPE, "estimator=k3"]))) == digest  # as the report calls it
    changed = rule_table()
    changed["fields"][0]["note"] += " (edited)"
    assert field_rule_digest(changed) != digest
    applied = {row["field"]: row for row in written["applied"]}
    assert applied["model.lora.r"]["value"] == 16
    assert applied["model.lora.r"]["verl"] == ["actor_rollout_ref.model.lora_rank=16"]


# ---------------------------------------------------------------- valid for verl 0.8.0


def test_an_export_over_an_earlier_one_keeps_what_the_user_edited_there(tmp_path):
    folder = tmp_path / "verl"
    export(compose_config(RECIPE), folder, cwd=ROOT)
    written = {p.name: p.read_bytes() for p in folder.iterdir()}
    export(compose_config(RECIPE), folder, cwd=ROOT)  # the same settings: the same files
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == written
    export(compose_config([*RECIPE, "actor.optim.lr=1e-4"]), folder, cwd=ROOT)  # its own files, unedited: replaced
    assert "actor_rollout_ref.actor.optim.lr=0.0001" in (folder / "overrides.txt").read_text()
    (folder / "run_opd.sh").write_text((folder / "run_opd.sh").read_text() + "# our cluster's module loads\n")
    edited = (folder / "run_opd.sh").read_bytes()
    with pytest.raises(MiniverlError) as refused:
        export(compose_config(RECIPE), folder, cwd=ROOT)
    assert str(refused.value) == (
        f"{folder} holds run_opd.sh that miniverl did not write there (edited since, or not an export of miniverl's) "
        "and this export would replace: choose another hydra.run.dir, or move them away"
    )
    assert (folder / "run_opd.sh").read_bytes() == edited
    assert "actor_rollout_ref.actor.optim.lr=0.0001" in (folder / "overrides.txt").read_text()  # nothing written


def test_a_refused_export_leaves_the_earlier_exports_record_and_a_replacing_one_writes_its_own(tmp_path, capfd):
    """Hydra writes .hydra/ before the export runs: in a folder holding an earlier export it is kept
    until this export is written (a refused one changes nothing there), and export.log has the lines."""
    from conftest import run_as_command

    def exported(*extra):
        return run_as_command("export", *RECIPE, "model=toy", "teacher=toy", f"hydra.run.dir={tmp_path}", *extra)

    def recorded():
        return (tmp_path / ".hydra" / "overrides.yaml").read_text()

    assert exported() == 0 and "estimator" not in recorded()
    (tmp_path / "verl" / "run_opd.sh").write_text((tmp_path / "verl" / "run_opd.sh").read_text() + "# ours\n")
    assert exported("estimator=k3") == 2
    assert "estimator" not in recorded()  # the record still says what verl/ holds
    assert "holds run_opd.sh that miniverl did not write there" in (tmp_path / "export.log").read_text()
    (tmp_path / "verl" / "run_opd.sh").unlink()  # the user moves it away, as the line says
    assert exported("estimator=k3") == 0 and "estimator=k3" in recorded()
    assert "loss_mode: k3" in (tmp_path / ".hydra" / "config.yaml").read_text()
    assert "launch written to" in (tmp_path / "export.log").read_text()
    capfd.readouterr()


def test_verl_yaml_defaults_table_matches_verl_0_8_0(verl_default):
    missing = object()
    for key, expected in VERL_DEFAULTS.items():
        node = verl_default
        for part in key.split("."):
            node = node.get(part, missing) if isinstance(node, dict) else missing
        assert node == expected, f"{key}: verl 0.8.0's YAML default is {node!r}, the table says {expected!r}"


def test_verl_dataclass_defaults_differ_from_its_yaml_where_the_table_says(verl_root):
    classes = verl_dataclasses(verl_root)
    for key, expected in DATACLASS_DEFAULTS_THAT_DIFFER.items():
        default = ast.literal_eval(classes["DistillationLossConfig"][2][key.split(".")[-1]])
        assert default == expected and default != VERL_DEFAULTS[key], key


@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("estimator", ["k1", "k3", "forward_kl_topk"])
@pytest.mark.slow
def test_export_composes_against_verl_0_8_0_and_passes_its_run_time_checks(
    tmp_path, verl_root, verl_default, estimator, scale
):
    lines = export_lines(tmp_path, [f"estimator={estimator}", *SCALES[scale]])
    written = parsed(lines)
    verl_cfg = compose_verl(verl_root, lines)  # an unknown key fails here
    assert not [m for m in sys.modules if m == "verl" or m.startswith("verl.")], "composition imported verl"
    assert type_errors(verl_root, verl_default, lines) == []
    resolved = OmegaConf.to_container(verl_cfg, resolve=True)
    for key, value in written.items():  # what the recipe means is what verl runs with
        assert OmegaConf.select(verl_cfg, key) == value, key
    # The rules verl enforces only at run time, read off the composed config.
    d = resolved["distillation"]
    inference = d["teacher_models"]["teacher_model"]["inference"]
    pool = d["nnodes"] * d["n_gpus_per_node"]
    replica = inference["tensor_model_parallel_size"] * inference["data_parallel_size"]
    assert pool > 0 and pool == d["teacher_models"]["teacher_model"]["num_replicas"] * replica
    actor, rollout = resolved["actor_rollout_ref"]["actor"], resolved["actor_rollout_ref"]["rollout"]
    assert actor["use_dynamic_bsz"] is False
    assert actor["ppo_micro_batch_size_per_gpu"] and rollout["log_prob_micro_batch_size_per_gpu"]
    data = resolved["data"]
    assert inference["max_model_len"] >= data["max_prompt_length"] + data["max_response_length"] + 1
    assert inference["prompt_length"] + inference["response_length"] + 1 <= inference["max_model_len"]
    assert rollout["name"] in ("vllm", "sglang") and inference["name"] == rollout["name"]
    loss = d["distillation_loss"]
    assert loss["loss_mode"] == estimator
    assert loss["use_policy_gradient"] is (estimator == "k1")  # k1 only with policy gradient
    assert inference["temperature"] == 1.0
    assert loss["use_task_rewards"] is False
    n_gpus = resolved["trainer"]["nnodes"] * resolved["trainer"]["n_gpus_per_node"]
    assert (data["train_batch_size"] // n_gpus) % actor["ppo_micro_batch_size_per_gpu"] == 0
    assert runtime_violations(resolved, "0.8.0") == []


@pytest.mark.parametrize("custom", [False, True], ids=["miniverl-rules", "users-function"])
@pytest.mark.slow
def test_a_recipe_with_task_rewards_exports_a_launch_verl_accepts(tmp_path, verl_root, verl_default, custom):
    fn = tmp_path / "my_reward.py"
    fn.write_text("def my_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0\n")
    extra = [f"reward.custom_reward_function.path={fn}", "reward.custom_reward_function.name=my_score"]
    result = export(
        compose_config(
            [
                "+recipe=opd_k1_grpo_toy",
                "export.verl_version=0.8.0",
                "algorithm.adv_estimator=rloo",
                *(extra if custom else []),
            ]
        ),
        tmp_path / "verl",
        cwd=ROOT,
    )
    verl_cfg = compose_verl(verl_root, result.lines)
    assert type_errors(verl_root, verl_default, result.lines) == []
    resolved = OmegaConf.to_container(verl_cfg, resolve=True)
    assert runtime_violations(resolved, "0.8.0") == []
    loss = resolved["distillation"]["distillation_loss"]
    assert loss["use_task_rewards"] is True and loss["distillation_loss_coef"] == 0.1
    assert resolved["actor_rollout_ref"]["rollout"]["n"] == 4 and resolved["algorithm"]["adv_estimator"] == "rloo"
    reward = resolved["reward"]["custom_reward_function"]
    if custom:  # the user's own function, where the trainer finds it; the export writes no scorer
        assert (reward["path"], reward["name"]) == (str(fn), "my_score")
        assert not (tmp_path / "verl" / "task_reward.py").exists()
    else:  # miniverl's rules, through verl's own scorers
        assert (reward["path"], reward["name"]) == (str(tmp_path / "verl" / "task_reward.py"), "compute_score")
        source = (tmp_path / "verl" / "task_reward.py").read_text()
        assert "from verl.utils.reward_score import default_compute_score, gsm8k" in source
        compile(source, "task_reward.py", "exec")
    assert not (tmp_path / "verl" / "no_task_reward.py").exists()
    # and back: the import gives the same miniverl fields
    text = import_verl.import_file(tmp_path / "verl" / "overrides.txt")
    values = parsed([line for line in text.splitlines() if line and not line.startswith("#")])
    assert values["estimator.use_task_rewards"] is True and values["rollout.n"] == 4
    assert values["reward.custom_reward_function.path"] == (str(fn) if custom else None)


def test_keys_whose_verl_defaults_differ_from_the_recipe_are_written_out(verl_root, recipe_lines):
    written = parsed(recipe_lines)
    for key in DATACLASS_DEFAULTS_THAT_DIFFER:  # written even where the YAML default happens to agree
        assert key in written, key
    assert written[f"{LOSS}.topk"] == 32 and written[f"{LOSS}.use_policy_gradient"] is True
    assert written[f"{LOSS}.loss_max_clamp"] == 10.0 and written[f"{LOSS}.log_prob_min_clamp"] == -10.0
    for key, _, _ in FIXED:
        assert key in written, key
    default, launched = compose_verl(verl_root, []), compose_verl(verl_root, recipe_lines)
    mapped = {key for rule in rules_for("0.8.0") if rule.status == "mapped" for key in rule.verl_keys}
    several = {key for key in mapped if "<name>" in key} | {"distillation.teacher_key"}  # with several teachers
    for key in (
        mapped
        - several
        - {
            "actor_rollout_ref.actor.ppo_max_token_len_per_gpu",
            "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu",
        }
    ):  # only with dynamic bsz
        assert key in written, f"{key} (a mapped key) is not written"
        if OmegaConf.select(default, key) != OmegaConf.select(launched, key):
            assert OmegaConf.select(launched, key) == written[key]


def test_dynamic_batch_size_writes_token_budgets_instead_of_micro_batches(tmp_path, verl_root):
    lines = export_lines(tmp_path, ["export.use_dynamic_bsz=true", "export.max_token_len_per_gpu=8192"])
    written = parsed(lines)
    assert written["actor_rollout_ref.actor.ppo_max_token_len_per_gpu"] == 8192
    assert "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu" not in written
    resolved = OmegaConf.to_container(compose_verl(verl_root, lines), resolve=True)
    assert resolved["actor_rollout_ref"]["rollout"]["log_prob_use_dynamic_bsz"] is True
    assert runtime_violations(resolved, "0.8.0") == []


def test_a_launch_with_every_knob_changed_composes_and_type_checks(tmp_path, verl_root, verl_default):
    lines = export_lines(tmp_path, EVERYTHING_CHANGED)
    assert "+data.apply_chat_template_kwargs.enable_thinking=False" in lines  # as verl's examples write it
    verl_cfg = compose_verl(verl_root, lines)
    assert type_errors(verl_root, verl_default, lines) == []
    for key, value in parsed(lines).items():
        assert OmegaConf.select(verl_cfg, key) == value, key
    assert runtime_violations(OmegaConf.to_container(verl_cfg, resolve=True), "0.8.0") == []


# Each setting with a value of its own, and the verl key it must land on, spelt out here apart from the
# field-rule table: the export/import round trip reads that table both ways, so two keys swapped in it
# (clip_ratio_low and clip_ratio_high, found by a tests audit) would pass it.
LANDS_ON = {
    "estimator.clip_ratio=0.15": ("distillation.distillation_loss.clip_ratio", 0.15),
    "estimator.clip_ratio_low=0.1": ("distillation.distillation_loss.clip_ratio_low", 0.1),
    "estimator.clip_ratio_high=0.28": ("distillation.distillation_loss.clip_ratio_high", 0.28),
    "estimator.loss_max_clamp=7.0": ("distillation.distillation_loss.loss_max_clamp", 7.0),
    "estimator.log_prob_min_clamp=-9.0": ("distillation.distillation_loss.log_prob_min_clamp", -9.0),
    "estimator.distillation_loss_coef=0.5": ("distillation.distillation_loss.distillation_loss_coef", 0.5),
    "actor.clip_ratio_low=0.12": ("actor_rollout_ref.actor.clip_ratio_low", 0.12),
    "actor.clip_ratio_high=0.26": ("actor_rollout_ref.actor.clip_ratio_high", 0.26),
    "actor.optim.lr=3e-6": ("actor_rollout_ref.actor.optim.lr", 3e-6),
    "actor.optim.weight_decay=0.02": ("actor_rollout_ref.actor.optim.weight_decay", 0.02),
    "rollout.top_p=0.9": ("actor_rollout_ref.rollout.top_p", 0.9),
    "rollout.top_k=40": ("actor_rollout_ref.rollout.top_k", 40),
    "data.seed=7": ("data.seed", 7),
    "recipe.prompt_limit=256": ("data.max_prompt_length", 256),
    "recipe.response_limit=512": ("data.max_response_length", 512),
    "recipe.logical_batch=16": ("data.train_batch_size", 16),
    "export.nnodes=4": ("trainer.nnodes", 4),
    "export.n_gpus_per_node=1": ("trainer.n_gpus_per_node", 1),
    "export.teacher_nnodes=1": ("distillation.nnodes", 1),
    "export.teacher_n_gpus_per_node=4": ("distillation.n_gpus_per_node", 4),
    "export.teacher_replicas=2": ("distillation.teacher_models.teacher_model.num_replicas", 2),
    "export.teacher_tensor_parallel_size=2": (
        "distillation.teacher_models.teacher_model.inference.tensor_model_parallel_size",
        2,
    ),
}


def test_each_setting_lands_on_its_own_verl_key(tmp_path):
    written = parsed(export_lines(tmp_path, list(LANDS_ON)))
    for override, (key, value) in LANDS_ON.items():
        assert written.get(key) == value, override


def test_the_type_check_catches_a_wrong_type(verl_root, verl_default):
    wrong = [
        "trainer.nnodes=one",
        "distillation.distillation_loss.topk=3.5",
        "actor_rollout_ref.model.lora_rank=True",
        "distillation.teacher_models.teacher_model.inference.gpu_memory_utilization=high",
    ]
    compose_verl(verl_root, wrong)  # Hydra alone accepts these: verl's YAML carries no types
    assert len(type_errors(verl_root, verl_default, wrong)) == len(wrong)


BROKEN = {  # overrides appended to a valid launch -> what verl would refuse at run time
    "teacher_replica_not_dividing_the_pool": (
        f"distillation.n_gpus_per_node=3 {TEACHER}.inference.tensor_model_parallel_size=2",
        "a single teacher's replica of 2 GPUs (tensor_model_parallel_size x data_parallel_size x "
        "pipeline_model_parallel_size) must divide the teacher pool of 3",
    ),
    "empty_teacher_pool": ("distillation.nnodes=0", "teacher pool is empty"),
    "no_micro_batch_without_dynamic_bsz": (
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=null",
        "ppo_micro_batch_size_per_gpu must be set",
    ),
    "micro_batch_not_dividing": ("actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=3", "must divide"),
    "teacher_context_too_short": (f"{TEACHER}.inference.max_model_len=150", "max_model_len=150 must be >="),
    "rollout_name_unset": ("actor_rollout_ref.rollout.name=null", "must name a rollout engine"),
    "k1_without_policy_gradient": (f"{LOSS}.use_policy_gradient=False", "k1 needs use_policy_gradient"),
    "teacher_temperature_not_1": (f"{TEACHER}.inference.temperature=0.7", "must be 1.0"),
    "rollout_tp_not_dividing_trainer": ("actor_rollout_ref.rollout.tensor_model_parallel_size=2", "not divisible"),
    "critic_built": ("algorithm.adv_estimator=gae", "critic"),
    "bypass_without_rollout_log_probs": (
        "algorithm.rollout_correction.bypass_mode=True actor_rollout_ref.rollout.calculate_log_probs=False",
        "needs actor_rollout_ref.rollout.calculate_log_probs=True",
    ),
}


def test_the_run_time_rules_hold_at_their_bounds(verl_root, recipe_lines):
    """At the limit verl accepts, one past it refused: the teacher's context of prompt + response + 1 tokens,
    vLLM's largest LoRA rank (a tests audit moved both bounds by one and every test passed)."""

    def problems(*extra):
        return runtime_violations(
            OmegaConf.to_container(compose_verl(verl_root, [*recipe_lines, *extra]), resolve=True), "0.8.0"
        )

    values = parsed(recipe_lines)
    needed = values["data.max_prompt_length"] + values["data.max_response_length"] + 1
    assert problems(f"{TEACHER}.inference.max_model_len={needed}") == []
    assert problems(f"{TEACHER}.inference.max_model_len={needed - 1}") == [
        f"{TEACHER}.inference.max_model_len={needed - 1} must be >= prompt + response + 1 = {needed}"
    ]
    assert problems("actor_rollout_ref.model.lora_rank=512") == []
    assert problems("actor_rollout_ref.model.lora_rank=513") == [
        "actor_rollout_ref.model.lora_rank=513 exceeds vLLM's largest LoRA rank 512"
    ]


def test_a_single_teachers_replicas_are_verls_to_set_so_a_pool_they_do_not_fill_runs(verl_root, recipe_lines):
    """verl sets a single teacher's num_replicas to what its pool holds (DistillationConfig, 0.8.0 and 0.9.1):
    the run-time check refused a pool of 2 beside num_replicas=1 as if verl would (a fidelity audit)."""
    wider = [*recipe_lines, "distillation.n_gpus_per_node=2"]
    assert runtime_violations(OmegaConf.to_container(compose_verl(verl_root, wider), resolve=True), "0.8.0") == []


@pytest.mark.parametrize("case", BROKEN)
@pytest.mark.slow
def test_run_time_rules_catch_what_verl_would_refuse(verl_root, recipe_lines, case):
    extra, message = BROKEN[case]
    resolved = OmegaConf.to_container(compose_verl(verl_root, [*recipe_lines, *extra.split()]), resolve=True)
    problems = runtime_violations(resolved, "0.8.0")
    assert any(message in p for p in problems), problems


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["export.teacher_replicas=2"],
            "the teacher pool (teacher_nnodes x teacher_n_gpus_per_node = 1 GPUs) must equal",
        ),
        (["export.nnodes=2", "export.n_gpus_per_node=4"], "must be divisible by the 8 trainer GPUs"),
        (["hardware.update_chunk=3"], "ppo_micro_batch_size_per_gpu=3 must divide"),
        (
            [
                "export.teacher_nnodes=3",
                "export.teacher_n_gpus_per_node=2",
                "export.teacher_replicas=2",
                "export.teacher_tensor_parallel_size=3",
            ],
            "a teacher replica would straddle two nodes",
        ),
        (["export.rollout_name=trtllm"], "export.rollout_name='trtllm'"),
        (["trainer.resume_from=outputs/a"], "a miniverl checkpoint cannot be resumed by verl"),
        (["estimator=reverse_kl_full"], "has no full-vocabulary reverse KL loss"),
        (["estimator=forward_kl_topk_tail"], "estimator=forward_kl_topk_tail: verl (v0.8.0, and v0.9 as well) has no"),
        (["estimator=reverse_kl_topk"], "reverse KL over the student's top-k (verl #7425 / #7590, not merged)"),
        (["estimator.kl_discount_factor=0.9"], "estimator.kl_discount_factor=0.9: verl's distillation advantage"),
        (["estimator.advantage_baseline=batch_mean"], "estimator.advantage_baseline=batch_mean: verl's distillation"),
        (
            ["estimator.token_selection.by=entropy", "estimator.token_selection.keep=0.5"],
            "estimator.token_selection.by=entropy: verl trains on every response token",
        ),
    ],
)
@pytest.mark.slow
def test_export_refuses_a_launch_verl_would_refuse_with_one_line(tmp_path, overrides, message):
    with pytest.raises(MiniverlError, match=None) as error:
        export(compose_config([*RECIPE, *overrides]), tmp_path / "verl", cwd=ROOT)
    assert message in str(error.value) and "\n" not in str(error.value)
    assert not (tmp_path / "verl").exists()


def test_lora_targets_the_students_architecture_lacks_are_refused_before_the_cluster_would(tmp_path):
    """The preset's q_proj, v_proj on a Phi-3 student (fused qkv_proj): verl's peft would fail on the
    cluster; the export reads the layer names from the folder's config.json alone (no weights) and
    refuses as `miniverl.main` does. A local folder also carries no hub revision into the launch."""
    from transformers import LlamaConfig, Phi3Config

    small = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=256)
    small.update(pad_token_id=0, bos_token_id=1, eos_token_id=2)
    phi3, llama = tmp_path / "phi3", tmp_path / "llama"
    Phi3Config(**small).save_pretrained(phi3)  # config.json only
    LlamaConfig(**small).save_pretrained(llama)
    with pytest.raises(MiniverlError) as error:
        export(compose_config([*RECIPE, f"model.model_id={phi3}", f"teacher.model_id={llama}"]), tmp_path / "a")
    assert str(error.value) == (
        "model.lora.target_modules: no layer of Phi3ForCausalLM is named q_proj, v_proj (its linear layers: "
        "o_proj, qkv_proj, gate_up_proj, down_proj); list those, or set model.lora.target_modules=all-linear"
    )
    assert not (tmp_path / "a").exists()
    fitting = export(compose_config([*RECIPE, f"model.model_id={llama}", f"teacher.model_id={llama}"]), tmp_path / "b")
    assert not any("revision" in warning for warning in fitting.warnings)  # the preset's Qwen3 commits dropped


def test_a_toy_export_is_a_template_that_composes_and_says_so(tmp_path, verl_root):
    result = export(compose_config([*RECIPE, "model=toy", "teacher=toy"]), tmp_path / "verl", cwd=ROOT)
    assert any("model.model_id=toy has no verl equivalent" in w for w in result.warnings)
    compose_verl(verl_root, result.lines)
    readme = (tmp_path / "verl" / "README.md").read_text()
    assert "toy has no verl equivalent" in readme and "4-bit student" in readme


def test_teacher_modes_export_as_verl_can_serve_them(tmp_path, verl_root):
    ref = export(compose_config([*RECIPE, "teacher.mode=ref"]), tmp_path / "ref", cwd=ROOT)
    written = parsed(ref.lines)
    assert written[f"{TEACHER}.model_path"] == written["actor_rollout_ref.model.path"] == "Qwen/Qwen3-0.6B"
    assert any("second copy of the student's base" in w for w in ref.warnings)
    compose_verl(verl_root, ref.lines)
    assert parsed(imported(tmp_path / "ref" / "overrides.txt"))["teacher.mode"] == "ref"
    adapter = tmp_path / "teacher_adapter"
    adapter.mkdir()
    for mode in ("standard", "shared_base"):
        with pytest.raises(MiniverlError, match="verl 0.8.0.s teacher takes no adapter"):
            export(
                compose_config([*RECIPE, f"teacher.mode={mode}", f"teacher.adapter={adapter}"]),
                tmp_path / mode,
                cwd=ROOT,
            )


def test_all_linear_targets_carry_over_both_ways_and_are_what_a_launch_without_targets_imports(tmp_path, verl_root):
    result = export(compose_config([*RECIPE, "model.lora.target_modules=all-linear"]), tmp_path / "verl", cwd=ROOT)
    assert parsed(result.lines)["actor_rollout_ref.model.target_modules"] == "all-linear"
    compose_verl(verl_root, result.lines)  # verl's own config takes it
    assert parsed(imported(tmp_path / "verl" / "overrides.txt"))["model.lora.target_modules"] == "all-linear"
    untargeted = tmp_path / "untargeted.txt"  # verl's default is all-linear: a launch that sets none means it
    untargeted.write_text("\n".join(line for line in result.lines if ".target_modules=" not in line) + "\n")
    assert parsed(imported(untargeted))["model.lora.target_modules"] == "all-linear"
    regex = tmp_path / "regex.txt"  # peft also takes a regex string: miniverl does not, so it is reported
    regex.write_text(untargeted.read_text() + "actor_rollout_ref.model.target_modules=.*q_proj\n")
    text = import_verl.import_file(regex, env={"HOME": "/home/user"})
    assert "model.lora.target_modules" not in parsed(imported(regex))
    assert "actor_rollout_ref.model.target_modules=\".*q_proj\"  -- '.*q_proj': miniverl takes a list" in text


def test_a_student_adapter_exports_with_its_own_rank_alpha_and_targets(tmp_path, verl_root):
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(
        json.dumps({"peft_type": "LORA", "r": 8, "lora_alpha": 24, "target_modules": ["q_proj", "k_proj"]})
    )
    result = export(compose_config([*RECIPE, f"model.adapter={adapter}"]), tmp_path / "verl", cwd=ROOT)
    written = parsed(result.lines)
    assert written["actor_rollout_ref.model.lora_adapter_path"] == str(adapter)
    assert (written["actor_rollout_ref.model.lora_rank"], written["actor_rollout_ref.model.lora_alpha"]) == (8, 24)
    assert written["actor_rollout_ref.model.target_modules"] == ["k_proj", "q_proj"]  # sorted: peft writes a set
    compose_verl(verl_root, result.lines)
    back = imported(tmp_path / "verl" / "overrides.txt")
    assert export(compose_config([*RECIPE, *back]), tmp_path / "verl", cwd=ROOT).lines == result.lines


# ---------------------------------------------------------------- the launch script


def fake_python(tmp_path: Path) -> dict:
    """A `python3` on PATH that prints its arguments after `-m verl.trainer.main_ppo`, one per line."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(parents=True)
    fake = bin_dir / "python3"
    fake.write_text(
        '#!/bin/sh\n[ "$1 $2" = "-m verl.trainer.main_ppo" ] || exit 9\nshift 2\n'
        'for a in "$@"; do printf "%s\\n" "$a"; done\n'
    )
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    env = {
        k: v for k, v in os.environ.items() if k not in ("STUDENT_MODEL", "TEACHER_MODEL", "TRAIN_FILES", "VAL_FILES")
    }
    return {**env, "PATH": f"{bin_dir}{os.pathsep}{env['PATH']}"}


def test_run_opd_sh_launches_exactly_overrides_txt(tmp_path):
    lines = export_lines(tmp_path, SCALES["2x4_trainer_gpus_plus_2_teacher_replicas_tp2"])
    script = tmp_path / "verl" / "run_opd.sh"
    assert os.access(script, os.X_OK)
    run = subprocess.run(["bash", str(script)], capture_output=True, text=True, env=fake_python(tmp_path), timeout=30)
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines() == lines
    again = subprocess.run(
        ["bash", str(script), "trainer.total_epochs=1"],
        capture_output=True,
        text=True,
        env={**fake_python(tmp_path / "x"), "STUDENT_MODEL": "/models/student"},
        timeout=30,
    )
    assert "actor_rollout_ref.model.path=/models/student" in again.stdout.splitlines()
    assert again.stdout.splitlines()[-1] == "trainer.total_epochs=1"


def test_run_opd_sh_refuses_toy_models(tmp_path):
    export(compose_config([*RECIPE, "model=toy", "teacher=toy"]), tmp_path / "verl", cwd=ROOT)
    run = subprocess.run(
        ["bash", str(tmp_path / "verl" / "run_opd.sh")],
        capture_output=True,
        text=True,
        env=fake_python(tmp_path),
        timeout=30,
    )
    assert run.returncode == 2 and "toy models have no verl equivalent" in run.stderr and run.stdout == ""


# ---------------------------------------------------------------- import and the round trip


def imported(path: Path, version: str | None = None) -> list[str]:  # None: the release the export wrote it for
    text = import_verl.import_file(path, env={"HOME": "/home/user"}, version=version)
    return [line for line in text.splitlines() if line and not line.startswith("#")]


@pytest.mark.parametrize("variant", ["recipe", "everything_changed"])
def test_export_import_export_is_a_fixed_point(tmp_path, variant):
    first = [] if variant == "recipe" else EVERYTHING_CHANGED
    lines = export_lines(tmp_path, first)
    back = imported(tmp_path / "verl" / "overrides.txt")
    assert imported(tmp_path / "verl" / "run_opd.sh") == back  # the script reads back the same
    for base in (RECIPE, []):  # on the recipe, or on the bare config: every mapped field is carried
        again = export(compose_config([*base, *back]), tmp_path / "verl", cwd=ROOT)
        assert again.lines == lines
    if variant == "everything_changed":
        values = parsed(back)
        assert values["model.lora.target_modules"] == ["q_proj", "k_proj", "v_proj", "o_proj"]
        assert values["export.teacher_tensor_parallel_size"] == 4 and values["export.rollout_name"] == "sglang"
        assert values["data.apply_chat_template_kwargs.enable_thinking"] is False
        assert values["trainer.logger"] == ["console", "tensorboard", "wandb"] and values["actor.optim.eps"] == 1e-6
        assert values["data.val_files"] == [str(ROOT / "data/held_out.parquet")]


@pytest.mark.parametrize("custom,task_rewards", [(False, False), (True, False), (False, True), (True, True)])
def test_the_reward_function_name_is_the_exports_own_unless_the_launch_scores_with_the_users_file(
    tmp_path, custom, task_rewards
):
    """The export's own scorer files (no_task_reward.py, task_reward.py) define compute_score: a name
    set in the config goes into the launch only with the user's own file, which only task rewards read."""
    fn = tmp_path / "my_reward.py"
    fn.write_text("def my_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.0\n")
    extra = [f"reward.custom_reward_function.path={fn}"] if custom else []
    extra += ["estimator.use_task_rewards=true", "rollout.n=4"] if task_rewards else []
    values = parsed(export_lines(tmp_path, ["reward.custom_reward_function.name=my_score", *extra]))
    assert values["reward.custom_reward_function.name"] == ("my_score" if custom and task_rewards else "compute_score")


def test_the_export_and_the_import_both_follow_a_changed_rule(tmp_path, monkeypatch):
    """One table: point a field's rule at another verl key, and the export writes that key and the
    import reads it back into the field, with no code changed."""
    from miniverl.verl_compat import field_rules

    rule = field_rules.RULES_BY_FIELD["data.prompt_key"]
    moved = dataclasses.replace(rule, verl_keys=("data.reward_fn_key",))  # a key verl has, unused here
    monkeypatch.setattr(field_rules, "RULES", tuple(moved if r is rule else r for r in field_rules.RULES))
    monkeypatch.setitem(field_rules.RULES_BY_FIELD, "data.prompt_key", moved)
    monkeypatch.setitem(VERL_DEFAULTS, "data.reward_fn_key", "data_source")  # verl's default, as the table holds
    lines = export_lines(tmp_path, ["data.prompt_key=messages"])
    assert "data.reward_fn_key=messages" in lines and not any(line.startswith("data.prompt_key=") for line in lines)
    assert parsed(imported(tmp_path / "verl" / "overrides.txt"))["data.prompt_key"] == "messages"
    document = json.loads((tmp_path / "verl" / "field_rules.json").read_text())
    (entry,) = [f for f in document["rules"] if f["field"] == "data.prompt_key"]
    assert entry["verl_keys"] == ["data.reward_fn_key"]
    (applied,) = [f for f in document["applied"] if f["field"] == "data.prompt_key"]
    assert applied["verl"] == ["data.reward_fn_key=messages"]


VERL_SHAPED_SCRIPT = r"""#!/usr/bin/env bash
# written the way verl's examples/on_policy_distillation_trainer scripts are
set -xeuo pipefail
STUDENT_MODEL=${STUDENT_MODEL:-Qwen/Qwen3-0.6B}
TEACHER_MODEL=${TEACHER_MODEL:-Qwen/Qwen3-1.7B}
NNODES=${NNODES:-1}
TEACHER_WORLD_SIZE=${TEACHER_WORLD_SIZE:-4}
teacher_tp=${TEACHER_TP:-2}
max_prompt_length=${MAX_PROMPT_LENGTH:-512}
max_response_length=${MAX_RESPONSE_LENGTH:-1024}
train_files="['$HOME/data/gsm8k/train.parquet']"
max_num_tokens=$(( max_prompt_length + max_response_length + 1 ))
DATA=(
    algorithm.adv_estimator=grpo
    data.train_files="$train_files"
    data.val_files="$train_files"
    data.train_batch_size=16
    data.max_prompt_length=${max_prompt_length}
    data.max_response_length=${max_response_length}
)
MODEL=(
    actor_rollout_ref.model.path="$STUDENT_MODEL"
    actor_rollout_ref.model.lora_rank=32
    actor_rollout_ref.model.target_modules='[q_proj,v_proj]'
)
ACTOR=(
    actor_rollout_ref.actor.ppo_mini_batch_size=16
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2
    actor_rollout_ref.rollout.name=vllm
    actor_rollout_ref.rollout.n=4
    actor_rollout_ref.rollout.max_model_len=${max_num_tokens}
    trainer.logger='["console","wandb"]'
    trainer.n_gpus_per_node=4
    trainer.nnodes=${NNODES}
    trainer.total_training_steps=50
    trainer.total_epochs=50
)
EXTRA=(
    distillation.enabled=True
    distillation.n_gpus_per_node=${TEACHER_WORLD_SIZE}
    distillation.nnodes=${NNODES}
    distillation.teacher_models.teacher_model.model_path="$TEACHER_MODEL"
    distillation.teacher_models.teacher_model.inference.tensor_model_parallel_size=${teacher_tp}
    distillation.teacher_models.teacher_model.inference.max_model_len=${max_num_tokens}
    distillation.distillation_loss.loss_mode=k3
    distillation.distillation_loss.use_task_rewards=False
)
python3 -m verl.trainer.main_ppo \
    "${DATA[@]}" \
    "${MODEL[@]}" \
    "${ACTOR[@]}" \
    "${EXTRA[@]}" \
    "$@"
"""


def test_import_reads_a_verl_example_shaped_script(tmp_path, verl_root):
    script = tmp_path / "run_qwen3_opd.sh"
    script.write_text(VERL_SHAPED_SCRIPT)
    lines = launch_reader.read_overrides(script, env={"HOME": "/home/user", "TEACHER_TP": "4"})
    compose_verl(verl_root, lines)  # the script's overrides are verl's
    assert "distillation.teacher_models.teacher_model.inference.max_model_len=1537" in lines
    assert "data.train_files=['/home/user/data/gsm8k/train.parquet']" in lines
    text = import_verl.import_file(script, env={"HOME": "/home/user", "TEACHER_TP": "4"})
    values = parsed([line for line in text.splitlines() if line and not line.startswith("#")])
    assert values["estimator"] == "k3" and values["estimator.use_policy_gradient"] is False  # verl's YAML default
    assert values["estimator.loss_max_clamp"] is None and values["estimator.topk"] == 32
    assert values["model.lora.r"] == 32 and values["model.lora.alpha"] == 16  # verl's default alpha
    assert values["export.teacher_tensor_parallel_size"] == 4 and values["export.teacher_replicas"] == 1
    assert values["hardware.update_chunk"] == 2 and values["recipe.logical_batch"] == 16
    assert values["trainer.logger"] == ["console", "wandb"] and values["data.shuffle"] is True
    assert values["data.train_files"] == ["/home/user/data/gsm8k/train.parquet"]
    assert values["data.val_files"] == []  # the script validates on its train files: nothing held out
    assert values["actor.optim.eps"] == 1e-8  # no override_optimizer_config: verl's AdamW default
    notes = "\n".join(line for line in text.splitlines() if line.startswith("#"))
    assert values["rollout.n"] == 4 and values["algorithm.adv_estimator"] == "grpo"
    assert values["estimator.use_task_rewards"] is False and values["reward.custom_reward_function.path"] is None
    assert "trainer.logger" not in notes  # every logger of the script is miniverl's too
    assert "model.quantization" in notes  # a miniverl field verl does not set
    # The imported overrides make a valid miniverl config that exports a launch verl accepts: the release the
    # import read it as (the script names none: 0.9.1), whose YAML has keys 0.8.0's lacks (rollout.seed).
    assert values["export.verl_version"] == "0.9.1"
    result = export(compose_config([*RECIPE, *values_to_lines(values)]), tmp_path / "verl", cwd=ROOT)
    compose_verl(verl_tree("0.9.1"), result.lines)


def test_a_variable_set_empty_takes_the_default_after_colon_dash_only(tmp_path):
    """bash: ${V:-d} gives d where V is unset or empty, ${V-d} only where unset (no test set a variable
    empty: a tests audit made the two alike and the export tests passed)."""
    script = tmp_path / "run.sh"
    script.write_text(
        "python3 -m verl.trainer.main_ppo \\\n"
        "    trainer.nnodes=${NODES:-2} \\\n"
        "    trainer.n_gpus_per_node=${GPUS-8} \\\n"
        "    trainer.project_name=p${EMPTY-x}\n"
    )
    lines = launch_reader.read_overrides(script, env={"NODES": "", "GPUS": "4", "EMPTY": ""})
    assert lines == ["trainer.nnodes=2", "trainer.n_gpus_per_node=4", "trainer.project_name=p"]


def values_to_lines(values: dict) -> list[str]:
    return [f"{key}={hydra_value(value)}" for key, value in values.items()]


def test_import_command_writes_the_overrides_and_refuses_a_launch_without_distillation(tmp_path, capsys):
    export(compose_config(RECIPE), tmp_path / "verl", cwd=ROOT)
    out = tmp_path / "miniverl_overrides.txt"
    assert import_command.main([str(tmp_path / "verl" / "overrides.txt"), "-o", str(out)]) == 0
    assert "estimator=k1" in out.read_text().splitlines()
    plain = tmp_path / "ppo.txt"
    plain.write_text("actor_rollout_ref.rollout.name=vllm\ntrainer.total_training_steps=3\n")
    assert import_command.main([str(plain)]) == 2
    assert capsys.readouterr().err.startswith("miniverl: error: this verl launch does not enable distillation")


def test_an_xargs_line_reading_overrides_txt_imports_that_file(tmp_path):
    """A new-user audit pasted the export README's `xargs ... < overrides.txt` line into a script: it
    was read as a launch without distillation."""
    export(compose_config(RECIPE), tmp_path / "verl", cwd=ROOT)
    launch = tmp_path / "verl" / "launch.sh"
    launch.write_text(
        "#!/bin/bash\nxargs -d '\\n' python3 -m verl.trainer.main_ppo trainer.total_epochs=2 < overrides.txt\n"
    )
    lines = launch_reader.read_overrides(launch, env={})
    overrides = launch_reader.read_overrides(tmp_path / "verl" / "overrides.txt", env={})
    assert lines == ["trainer.total_epochs=2", *overrides]  # xargs puts stdin's words after the command's
    (tmp_path / "verl" / "overrides.txt").unlink()
    with pytest.raises(MiniverlError, match="reads overrides.txt, which is not beside the script"):
        launch_reader.read_overrides(launch, env={})


def test_import_o_never_replaces_another_file_but_writes_the_same_import_again(tmp_path, capsys):
    export(compose_config(RECIPE), tmp_path / "verl", cwd=ROOT)
    out = tmp_path / "imported.txt"
    out.write_text("my notes\n")
    assert import_command.main([str(tmp_path / "verl" / "overrides.txt"), "-o", str(out)]) == 2
    assert capsys.readouterr().err == (
        f"miniverl: error: -o {out} exists and holds other text; choose another -o, or remove it first\n"
    )
    assert out.read_text() == "my notes\n"
    out.unlink()
    for _ in range(2):
        assert import_command.main([str(tmp_path / "verl" / "overrides.txt"), "-o", str(out)]) == 0
    assert "estimator=k1" in out.read_text().splitlines()


@pytest.mark.parametrize(
    "value",
    [
        None,
        True,
        False,
        0,
        -1,
        3,
        0.5,
        1e-05,
        -10.0,
        1.0,
        "vllm",
        "token-mean",
        "none",
        "null",
        "True",
        "1",
        "1e-3",
        "Qwen/Qwen3-0.6B",
        "/a b/c.parquet",
        "~/data/gsm8k/test.parquet",  # verl's default val_files: a bare ~ is a deletion to Hydra
        ["~/data/x.parquet"],
        "x:y,z",
        'q"t',
        "it's",
        ["/abs/x.parquet"],
        ["q_proj", "v_proj"],
        [0.9, 0.999],
        {"eps": 1e-08},
        {"enable_thinking": False},
        {},
    ],
)
def test_override_values_parse_back_to_themselves(value):
    (override,) = OverridesParser.create().parse_overrides([f"a.b={hydra_value(value)}"])
    assert override.value() == value and type(override.value()) is type(value)


# ---------------------------------------------------------------- the command


@pytest.mark.slow
def test_export_command_writes_the_launch_into_its_run_folder(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    env.pop("HYDRA_FULL_ERROR", None)
    run_dir = tmp_path / "run"
    ok = subprocess.run(
        [sys.executable, "-m", "miniverl.export", *RECIPE, f"hydra.run.dir={run_dir}"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=120,
    )
    assert ok.returncode == 0, ok.stderr
    assert str(run_dir / "verl") in ok.stdout
    for name in ("overrides.txt", "run_opd.sh", "field_rules.json", "README.md", "no_task_reward.py"):
        assert (run_dir / "verl" / name).is_file(), name
    assert "miniverl: warning: model.quantization=nf4 does not carry over" in ok.stderr
    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "miniverl.export",
            *RECIPE,
            "export.teacher_replicas=2",
            f"hydra.run.dir={tmp_path / 'bad'}",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=120,
    )
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert bad.stderr.strip().splitlines()[-1].startswith("miniverl: error: export: the teacher pool")


def test_import_keeps_a_users_task_reward_py_and_lists_verls_default_gae(tmp_path):
    result = export(
        compose_config(["+recipe=opd_k1_grpo_toy", "export.verl_version=0.8.0"]), tmp_path / "verl", cwd=ROOT
    )
    own = tmp_path / "mine" / "task_reward.py"  # the user's file, under the export's file name
    own.parent.mkdir()
    own.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0\n")
    lines = [
        f"reward.custom_reward_function.path={own}" if line.startswith("reward.custom_reward_function.path=") else line
        for line in result.lines
        if not line.startswith("algorithm.adv_estimator=")  # left out: verl runs its default, gae
    ]
    mapped, unmapped = import_verl.to_miniverl(lines)
    values = dict(mapped)
    assert values["reward.custom_reward_function.path"] == str(own)
    assert "algorithm.adv_estimator" not in values
    assert any(line == "algorithm.adv_estimator=gae (verl's default)" for line, _ in unmapped)
    # The export's own scorer, where it was written, imports as miniverl's rules, and says so.
    mapped, unmapped = import_verl.to_miniverl(result.lines)
    assert dict(mapped)["reward.custom_reward_function.path"] is None
    assert any("the export's own scorer" in why for _, why in unmapped)


def test_a_single_teachers_num_replicas_that_verl_overwrites_is_listed_as_not_imported(tmp_path):
    """verl sets one teacher's replicas from the pool (DistillationConfig); a launch's own value was dropped unsaid."""
    lines = export(compose_config(RECIPE), tmp_path / "verl", cwd=ROOT).lines
    given = [line for line in lines if not line.startswith(f"{TEACHER}.num_replicas=")]
    mapped, unmapped = import_verl.to_miniverl([*given, f"{TEACHER}.num_replicas=3"])
    assert dict(mapped)["export.teacher_replicas"] == 1  # the pool's one GPU, as verl resolves it
    assert any(line == f"{TEACHER}.num_replicas=3" and "imported as 1" in why for line, why in unmapped)
    assert not any(line.startswith(f"{TEACHER}.num_replicas") for line, _ in import_verl.to_miniverl(lines)[1])


def test_verl_defaults_a_launch_leaves_are_imported_as_verl_runs_them_or_listed(tmp_path):
    """A new-user audit's launch left data.seed (verl: null, torch's default generator seed) and
    distillation.nnodes (verl: 0) at verl's defaults: imported as miniverl's seed 1 and a pool of 0 GPUs, without
    a word. The seed is now imported as null, the order verl's sampler draws (tests/trainer/test_plan.py); the
    pool is listed."""
    lines = export(compose_config([*RECIPE, "data.shuffle=true"]), tmp_path / "verl", cwd=ROOT).lines
    left = [line for line in lines if not line.startswith(("data.seed=", "distillation.nnodes="))]
    mapped, unmapped = import_verl.to_miniverl(left)
    assert dict(mapped)["data.seed"] is None and dict(mapped)["data.shuffle"] is True
    assert not any(line.startswith("data.seed") for line, _ in unmapped)
    assert any(line.startswith("distillation.nnodes=0") and "no GPU for the teacher's pool" in why
               for line, why in unmapped)  # fmt: skip
    whole = import_verl.to_miniverl(lines)
    assert dict(whole[0])["data.seed"] == 1
    assert not any(line.startswith(("data.seed", "distillation.nnodes")) for line, _ in whole[1])


def test_a_teacher_temperature_inherited_from_the_rollout_is_listed_where_verl_refuses_it(tmp_path):
    """verl 0.8.0's teacher temperature defaults to the rollout's, and its start-up refuses any but 1.0: a
    launch with a sampling temperature and no teacher temperature does not run there (0.9 forces 1.0)."""
    lines = export(compose_config(RECIPE), tmp_path / "verl", cwd=ROOT).lines
    kept = [
        line
        for line in lines
        if not line.startswith(("actor_rollout_ref.rollout.temperature=", f"{TEACHER}.inference.temperature="))
    ]
    warm = [*kept, "actor_rollout_ref.rollout.temperature=0.7"]
    listed = dict(import_verl.to_miniverl(warm, "0.8.0")[1])
    assert "verl 0.8.0 refuses a teacher temperature other than 1.0" in listed[f"{TEACHER}.inference.temperature=0.7"]
    assert not any(line.startswith(f"{TEACHER}.inference") for line, _ in import_verl.to_miniverl(warm, "0.9.1")[1])
    given = [*warm, f"{TEACHER}.inference.temperature=1.0"]  # the export's own launch sets it
    assert not any(line.startswith(f"{TEACHER}.inference") for line, _ in import_verl.to_miniverl(given, "0.8.0")[1])


# ---------------------------------------------------------------- several teachers

TWO_TEACHERS = [
    *RECIPE,
    "+teacher@teachers.math=qwen3_1_7b",
    "teachers.math.key=openai/gsm8k",
    "+teacher@teachers.code=qwen3_1_7b",
    "teachers.code.key=code/contests",
    "teachers.code.model_id=Qwen/Qwen3-4B",
    "teachers.code.revision=null",
    "export.teacher_n_gpus_per_node=4",
    "export.teacher_tensor_parallel_size=2",
]


@pytest.fixture(scope="module")
def two_teacher_lines(tmp_path_factory) -> list[str]:
    return export(compose_config(TWO_TEACHERS), tmp_path_factory.mktemp("two") / "verl", cwd=ROOT).lines


def test_several_teachers_export_as_verl_entries_that_compose_and_pass_its_run_time_checks(
    tmp_path, verl_root, verl_default
):
    result = export(compose_config(TWO_TEACHERS), tmp_path / "verl", cwd=ROOT)
    assert all(line.startswith("+") for line in result.lines if ".teacher_models.math." in line)  # new entries
    verl_cfg = compose_verl(verl_root, result.lines)
    assert type_errors(verl_root, verl_default, result.lines) == []
    resolved = OmegaConf.to_container(verl_cfg, resolve=True)
    d = resolved["distillation"]
    assert set(d["teacher_models"]) == {"teacher_model", "math", "code"}  # verl drops teacher_model itself
    assert (d["teacher_models"]["math"]["key"], d["teacher_models"]["code"]["key"]) == ("openai/gsm8k", "code/contests")
    assert d["teacher_models"]["code"]["model_path"] == "Qwen/Qwen3-4B" and d["teacher_key"] == "data_source"
    pool = d["nnodes"] * d["n_gpus_per_node"]
    served = [d["teacher_models"][n] for n in ("math", "code")]
    assert pool == sum(t["num_replicas"] * t["inference"]["tensor_model_parallel_size"] for t in served) == 4
    for t in served:  # a new entry does not read the rollout's lengths: they are written
        assert (
            t["inference"]["prompt_length"] + t["inference"]["response_length"] + 1 <= t["inference"]["max_model_len"]
        )
        # and loads its checkpoint as the shipped entry does: the dataclass's "dummy" serves random weights
        # (a fidelity audit against verl 0.9.1's code; 0.8.0's the same)
        assert (
            t["inference"]["load_format"] == d["teacher_models"]["teacher_model"]["inference"]["load_format"] == "auto"
        )
    assert runtime_violations(resolved, "0.8.0") == []
    script = (tmp_path / "verl" / "run_opd.sh").read_text()
    assert "TEACHER_MATH_MODEL=${TEACHER_MATH_MODEL:-Qwen/Qwen3-1.7B}" in script
    assert '+distillation.teacher_models.code.model_path="$TEACHER_CODE_MODEL"' in script


def test_several_teachers_export_import_export_is_a_fixed_point(tmp_path):
    first = export(compose_config(TWO_TEACHERS), tmp_path / "verl", cwd=ROOT)
    back = imported(tmp_path / "verl" / "overrides.txt")
    values = parsed([line for line in back if not line.startswith("+teacher@")])
    assert values["teachers.code.key"] == "code/contests" and values["teachers.code.model_id"] == "Qwen/Qwen3-4B"
    assert values["export.teacher_replicas"] == 1 and values["export.teacher_tensor_parallel_size"] == 2
    assert not any(line.startswith("teacher.") for line in back)  # the single teacher is not read
    for base in (RECIPE, []):
        assert export(compose_config([*base, *back]), tmp_path / "verl", cwd=ROOT).lines == first.lines


def test_toy_teachers_import_as_separate_models_not_the_students_base(tmp_path):
    export(
        compose_config(["+recipe=opd_k1_two_teachers_toy", "export.verl_version=0.8.0"]), tmp_path / "verl", cwd=ROOT
    )
    values = parsed([line for line in imported(tmp_path / "verl" / "overrides.txt") if not line.startswith("+")])
    assert values["teachers.arithmetic.mode"] == values["teachers.echo.mode"] == "standard"  # toy == toy is no ref


@pytest.mark.parametrize(
    "extra,message",
    [
        (["export.teacher_n_gpus_per_node=2"], "must equal 2 teachers x teacher_replicas x teacher_tensor_parallel"),
        (["default_teacher=math"], "default_teacher=math: verl 0.8.0 has no default teacher"),
        (
            ["+teacher@teachers.teacher_model=toy", "teachers.teacher_model.key=k", "export.teacher_n_gpus_per_node=6"],
            "teachers.teacher_model: verl 0.8.0 drops the entry of that name",
        ),
    ],
)
def test_a_several_teacher_export_verl_would_not_run_is_one_line(tmp_path, extra, message):
    with pytest.raises(MiniverlError, match=message):
        export(compose_config([*TWO_TEACHERS, *extra]), tmp_path / "verl", cwd=ROOT)
    assert not (tmp_path / "verl").exists()


@pytest.mark.parametrize(
    "extra,message",
    [
        (["+distillation.teacher_models.code.key=openai/gsm8k"], "have the same key 'openai/gsm8k'"),
        (["distillation.n_gpus_per_node=6"], "add up to 4 GPUs; the teacher pool"),
        (["+distillation.teacher_models.code.model_path=null"], "teacher_models.code.model_path must be set"),
    ],
)
@pytest.mark.slow
def test_run_time_rules_of_several_teachers_catch_what_verl_would_refuse(two_teacher_lines, verl_root, extra, message):
    lines = two_teacher_lines
    lines = [
        line for line in lines if not any(line.lstrip("+~").startswith(e.lstrip("+~").split("=")[0]) for e in extra)
    ]
    resolved = OmegaConf.to_container(compose_verl(verl_root, [*lines, *extra]), resolve=True)
    assert any(message in p for p in runtime_violations(resolved, "0.8.0")), runtime_violations(resolved, "0.8.0")


def test_importing_a_file_that_is_not_there_is_one_line_naming_where_a_launch_comes_from(tmp_path, capsys):
    assert import_command.main([str(tmp_path / "run_opd.sh")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        f"miniverl: error: cannot read {tmp_path / 'run_opd.sh'}: No such file or directory; give a verl launch "
        "script or overrides file, such as the verl/run_opd.sh or verl/overrides.txt that `python -m "
        "miniverl.export +recipe=<name>` writes into its run folder"
    )


def test_importing_what_is_no_launch_or_into_a_folder_is_one_line(tmp_path, capsys):
    give = "give a verl launch script or overrides file"
    (tmp_path / "binary.sh").write_bytes(b"\x00\x01\xff\xfe")
    (tmp_path / "report.json").write_text('{"a": 1}\n')
    (tmp_path / "empty.txt").write_text("")
    assert import_command.main([str(tmp_path / "binary.sh")]) == 2
    assert capsys.readouterr().err.startswith(f"miniverl: error: cannot read {tmp_path / 'binary.sh'}: not a text file")
    for name in ("report.json", "empty.txt"):  # before: "this verl launch does not enable distillation"
        assert import_command.main([str(tmp_path / name)]) == 2
        err = capsys.readouterr().err
        assert (
            err.startswith(f"miniverl: error: {tmp_path / name}: neither a launch script nor overrides") and give in err
        )
    launch = tmp_path / "overrides.txt"
    launch.write_text("distillation.enabled=True\n")
    assert import_command.main([str(launch), "-o", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"miniverl: error: -o {tmp_path} is a folder; give the file to write the overrides to"
    )


def test_an_export_from_another_directory_points_at_the_shipped_prompts(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = export(compose_config([*RECIPE, "model=toy", "teacher=toy"]), tmp_path / "verl")
    assert parsed(result.lines)["data.train_files"] == [str(ROOT / "data" / "toy_prompts.parquet")]
    assert not any("does not exist here" in w for w in result.warnings)


def test_local_model_folders_export_as_absolute_paths_and_hub_ids_as_they_are(tmp_path):
    """run_opd.sh runs from any folder: a relative local folder would be looked for where it starts, or
    read as a hub id; the export writes it absolute, as it writes the data files."""
    for name in ("student", "teacher", "tokenizer"):
        (tmp_path / "models" / name).mkdir(parents=True)
    folders = [
        "model.model_id=models/student",
        "teacher.model_id=./models/teacher",
        "model.tokenizer_id=models/tokenizer",
    ]
    local = parsed(export(compose_config([*RECIPE, *folders]), tmp_path / "local", cwd=tmp_path).lines)
    assert local["actor_rollout_ref.model.path"] == str(tmp_path / "models" / "student")
    assert local[f"{TEACHER}.model_path"] == str(tmp_path / "models" / "teacher")
    assert local["actor_rollout_ref.model.tokenizer_path"] == str(tmp_path / "models" / "tokenizer")
    hub = parsed(
        export(compose_config([*RECIPE, "model.model_id=models/absent"]), tmp_path / "hub", cwd=tmp_path).lines
    )
    assert hub["actor_rollout_ref.model.path"] == "models/absent"  # no such folder here: a hub id, as written


@pytest.mark.slow
def test_a_swept_export_writes_each_jobs_launch_and_exits_0_without_a_training_summary(tmp_path):
    """A new-user audit swept the export (-m): both launches written, then "0 of 2 jobs completed", exit 1."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    env.pop("HYDRA_FULL_ERROR", None)
    swept = [sys.executable, "-m", "miniverl.export", "-m", *RECIPE, "estimator=k1,k3", f"hydra.sweep.dir={tmp_path}"]
    done = subprocess.run(swept, capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "failed" not in done.stderr and not (tmp_path / "sweep_summary.md").exists()
    for job, estimator in ((0, "k1"), (1, "k3")):
        assert f"loss_mode={estimator}" in (tmp_path / str(job) / "verl" / "overrides.txt").read_text()


@pytest.mark.parametrize(
    "script,what",
    [
        ('#!/bin/bash\npython3 -m verl.trainer.main_ppo "distillation.enabled=True\n', "IndexError"),  # no closing "
        ("python3 -m verl.trainer.main_ppo trainer.total_training_steps=$((3/0))\n", "ZeroDivisionError"),
        ("# verl launch\nSee the field's rules: python3 -m verl.trainer.main_ppo < overrides.txt\n", "ValueError"),
    ],
)
def test_a_launch_the_reader_cannot_parse_is_one_line_not_a_traceback(tmp_path, capsys, script, what):
    """A new-user audit fed the export's README.md (an apostrophe in its prose), an unclosed quote and $((3/0))."""
    launch = tmp_path / "run.sh"
    launch.write_text(script)
    assert import_command.main([str(launch)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"miniverl: error: {launch}: cannot read it as a shell script ({what}")
    assert err.count("\n") == 1
    assert import_command.main([str(launch), "-o", "/proc/miniverl-x"]) == 2  # first the launch, then -o
    export(compose_config(RECIPE), tmp_path / "verl", cwd=ROOT)
    assert import_command.main([str(tmp_path / "verl" / "overrides.txt"), "-o", "/proc/miniverl-x"]) == 2
    said = "cannot write /proc/miniverl-x: No such file or directory; choose another -o\n"
    assert capsys.readouterr().err.endswith(said)


def test_an_export_of_plain_string_prompts_warns_that_verl_reads_message_lists(tmp_path):
    """A new-user audit exported a file of plain-string prompts (miniverl's one user message each) without
    a word: verl's dataset hands each prompt to the chat template, which needs a message list."""
    plain = tmp_path / "plain.parquet"
    pq.write_table(pa.table({"prompt": ["What is 2 + 2?", "Name a sea."]}), plain)
    result = export(compose_config([*RECIPE, f"data.train_files=[{plain}]"]), tmp_path / "verl")
    said = [w for w in result.warnings if "plain-string prompts" in w]
    assert said == [
        "data.train_files holds plain-string prompts in 2 rows (column 'prompt'): verl reads each prompt as a list "
        "of {role, content} messages, which its chat template needs; store each as [{'role': 'user', 'content': "
        "<the text>}]"
    ]
    assert said[0] in (tmp_path / "verl" / "README.md").read_text()
    shipped = export(compose_config(RECIPE), tmp_path / "verl2")
    assert not any("plain-string" in w for w in shipped.warnings)


def test_a_hand_written_launch_imports_to_overrides_the_run_takes_and_lists_what_verl_refuses(tmp_path):
    """A new-user audit's launches: a Qwen3-8B teacher kept the recipe's Qwen3-1.7B commit pin (and the load
    error's download hint named it); distillation.nnodes left at verl's 0 imported export.teacher_nnodes=0,
    which the run refuses; a pool of one GPU for a teacher of tensor parallel 2 was said to be verl's defaults;
    k1 without use_policy_gradient and an unset rollout name imported without a word that verl refuses them."""
    base = [
        "distillation.enabled=True",
        f"{TEACHER}.model_path=Qwen/Qwen3-8B",
        "actor_rollout_ref.model.path=Qwen/Qwen3-0.6B",
        "distillation.distillation_loss.loss_mode=k1",
        "distillation.distillation_loss.use_policy_gradient=True",
        "trainer.total_training_steps=10",
    ]
    mapped, unmapped = import_verl.to_miniverl(base, "0.9.1")
    values, refused = dict(mapped), [line for line, why in unmapped if why == REFUSED_WHY]
    assert values["teacher.model_id"] == "Qwen/Qwen3-8B" and values["teacher.revision"] is None
    assert values["model.revision"] is None and values["model.tokenizer_revision"] is None
    assert not any(name.startswith("export.teacher_") for name in values) and "export.rollout_name" not in values
    assert any(line.startswith("distillation.nnodes=0") and "no GPU for the teacher's pool" in why
               for line, why in unmapped)  # fmt: skip
    assert any(line.startswith("the teacher pool is empty") for line in refused)
    assert not any("use_policy_gradient" in line for line in refused)
    assert any(line.startswith("actor_rollout_ref.rollout.name='???'") for line in refused)
    cfg = to_config(compose_config(["+recipe=opd_k1", *import_render.override_lines(mapped)]))  # the run takes them
    assert (cfg.teacher.revision, cfg.export.teacher_nnodes) == (None, 1)
    text = import_verl.render("launch", mapped, unmapped, "0.9.1")
    assert "# verl 0.9.1 would refuse this launch at run time" in text
    no_pg = [line for line in base if "use_policy_gradient" not in line]  # verl 0.9.1's default: False
    _, unmapped = import_verl.to_miniverl(no_pg, "0.9.1")
    assert any("loss_mode=k1 needs use_policy_gradient=True" in line for line, why in unmapped if why == REFUSED_WHY)
    one_gpu = [*base, "distillation.nnodes=1", "distillation.n_gpus_per_node=1"]  # verl's teacher TP is 2
    _, unmapped = import_verl.to_miniverl(one_gpu, "0.9.1")
    assert any(line == "distillation.nnodes=1, n_gpus_per_node=1" and why.startswith(
        "a pool of 1 GPUs holds no teacher replica of 2") for line, why in unmapped)  # fmt: skip


@pytest.mark.parametrize("version", ["0.9.1", "0.8.0"])
def test_data_of_fewer_rows_than_one_batch_is_said_to_stop_verl_at_start_up(tmp_path, version):
    """verl runs whole batches over the data: 0.9.1's V1 trainer divides by rows // train_batch_size, 0.8.0
    refuses an empty dataloader; miniverl repeats prompts (a fidelity audit exported 128 of 64 rows silently)."""
    over = [*RECIPE, "recipe.logical_batch=128", "data.repeat_prompts=true", f"export.verl_version={version}"]
    said = [w for w in export(compose_config(over), tmp_path / "verl", cwd=ROOT).warnings if "fewer than one" in w]
    stop = "'Train dataloader is empty!'" if version == "0.8.0" else "0 steps per epoch: a division by zero"
    assert said == [
        "data.train_files hold 64 rows, fewer than one batch (recipe.logical_batch=128, verl's data.train_batch_size): "
        f"verl {version} stops at start-up ({stop}); give the launch more rows (TRAIN_FILES=...) or lower "
        "recipe.logical_batch"
    ]
    fits = export(compose_config([*RECIPE, f"export.verl_version={version}"]), tmp_path / "fits", cwd=ROOT)
    assert not any("fewer than one" in w for w in fits.warnings)
