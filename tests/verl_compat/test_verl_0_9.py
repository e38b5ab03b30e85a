"""verl 0.9.1 beside 0.8.0: the export for 0.9.1 (the default) composes against verl 0.9.1's own
config tree and passes its run-time rules, for k1, k3, forward_kl_topk (chunked too), token-sum,
task rewards with GRPO and several teachers; what only one release has is refused for the other in
one line; the import reads either; each export carries its own release's identity.
(test_export.py checks the 0.8.0 export in depth; verl_oracle.py says how the trees are installed.)
"""

from __future__ import annotations

import ast
import json

import pytest
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf
from test_export import TWO_TEACHERS as TWO_TEACHERS_0_8
from verl_oracle import compose_verl, type_errors, verl_dataclasses, verl_tree

from miniverl.utils.errors import MiniverlError
from miniverl.verl_compat import import_verl
from miniverl.verl_compat.defaults import LOSS, TEACHER, VERL_DEFAULTS, verl_defaults
from miniverl.verl_compat.field_rules import RULES_BY_FIELD, rule_table, rules_for, table_written
from miniverl.verl_compat.launch_writer import export, field_rule_digest
from miniverl.verl_compat.runtime_checks import runtime_violations
from miniverl.verl_compat.versions import RELEASES

from conftest import ROOT, compose_config

RECIPE = ["+recipe=opd_k1"]  # export.verl_version: 0.9.1 by default
TWO_TEACHERS = [line for line in TWO_TEACHERS_0_8 if line != "export.verl_version=0.8.0"]  # the same, for 0.9.1
LAUNCHES = {  # what the issue names: k1, k3, forward_kl_topk, task rewards with GRPO, several teachers
    "k1": RECIPE,
    "k3": [*RECIPE, "estimator=k3"],
    "forward_kl_topk": [*RECIPE, "estimator=forward_kl_topk"],
    "forward_kl_topk_chunked": [
        *RECIPE,
        "estimator=forward_kl_topk",
        "estimator.use_chunked_topk=true",
        "estimator.chunked_topk_chunk_size=1024",
    ],
    "k3_token_sum": [*RECIPE, "estimator=k3", "estimator.loss_agg_mode=token-sum"],
    "task_rewards_grpo": ["+recipe=opd_k1_grpo_toy"],
    "two_teachers": TWO_TEACHERS,
}


@pytest.fixture(scope="module")
def tree():
    return verl_tree("0.9.1")


@pytest.fixture(scope="module")
def raw_default(tree):
    return OmegaConf.to_container(compose_verl(tree, []), resolve=False)


def parsed(lines: list[str]) -> dict:
    return {o.key_or_group: o.value() for o in OverridesParser.create().parse_overrides(lines)}


def test_the_defaults_table_of_0_9_1_matches_verl_0_9_1(tree, raw_default):
    outside = set(RELEASES["0.9.1"].defaults_outside_yaml)
    for key, expected in verl_defaults("0.9.1").items():
        node = raw_default
        for part in key.split("."):
            node = node.get(part, "<missing>") if isinstance(node, dict) else "<missing>"
        if key in outside:  # in the dataclass only: checked against its source below
            assert node == "<missing>", f"{key} is in 0.9.1's YAML now"
            continue
        assert node == expected, f"{key}: verl 0.9.1's YAML default is {node!r}, the table says {expected!r}"
    fields = verl_dataclasses(tree)["DistillationLossConfig"][2]
    for key, value in RELEASES["0.9.1"].defaults_outside_yaml.items():
        if key.startswith(f"{LOSS}."):  # the dataclass's default (reward_kwargs: get_custom_reward_fn's {})
            assert ast.literal_eval(fields[key.rsplit(".", 1)[1]]) == value, key
    # What 0.9.1 changed is what the release says it changed (one place for each fact).
    changed = {k for k, v in verl_defaults("0.9.1").items() if VERL_DEFAULTS.get(k, "<none>") != v}
    assert changed == set(RELEASES["0.9.1"].defaults_changed) | outside


@pytest.mark.slow
@pytest.mark.parametrize("launch", list(LAUNCHES))
def test_the_0_9_1_export_composes_against_verl_0_9_1_and_passes_its_run_time_checks(
    tmp_path, tree, raw_default, launch
):
    result = export(compose_config(LAUNCHES[launch]), tmp_path / "verl", cwd=ROOT)
    verl_cfg = compose_verl(tree, result.lines)  # an unknown key fails here
    assert type_errors(tree, raw_default, result.lines) == []
    for key, value in parsed(result.lines).items():  # what the recipe means is what verl runs with
        assert OmegaConf.select(verl_cfg, key) == value, key
    resolved = OmegaConf.to_container(verl_cfg, resolve=True)
    assert runtime_violations(resolved, "0.9.1") == []
    loss = resolved["distillation"]["distillation_loss"]
    assert loss["use_chunked_topk"] is (launch == "forward_kl_topk_chunked")
    assert resolved["actor_rollout_ref"]["actor"]["loss_agg_mode"] == (
        "token-sum" if launch == "k3_token_sum" else "token-mean"
    )
    assert not any("#7200" in w for w in result.warnings)  # 0.9 normalises per mini-batch
    rules = json.loads((result.folder / "field_rules.json").read_text())
    assert rules["verl"]["version"] == "0.9.1" and rules["field_rule_digest"] == field_rule_digest(version="0.9.1")
    assert "for verl v0.9.1" in (result.folder / "run_opd.sh").read_text()


def test_each_release_has_its_own_identity_and_the_profile_stays_on_0_8_0():
    assert field_rule_digest() == field_rule_digest(version="0.8.0") != field_rule_digest(version="0.9.1")
    assert rule_table()["verl"]["tag"] == "v0.8.0" and rule_table("0.9.1")["verl"]["tag"] == "v0.9.1"
    chunked = RULES_BY_FIELD["estimator.use_chunked_topk"]
    assert chunked.for_release("0.9.1") is chunked and chunked.for_release("0.8.0").status == "no_verl_equivalent"
    assert ("estimator.use_chunked_topk", f"{LOSS}.use_chunked_topk") in table_written("0.9.1")
    assert not any(field == "estimator.use_chunked_topk" for field, _ in table_written("0.8.0"))
    assert {r.field for r in rules_for("0.8.0")} == {r.field for r in rules_for("0.9.1")}  # every field, both


@pytest.mark.parametrize(
    "extra, message",
    [
        (
            ["estimator.loss_agg_mode=token-sum"],
            "estimator.loss_agg_mode=token-sum: verl 0.8.0 has only token-mean, seq-mean-token-sum, "
            "seq-mean-token-mean, seq-mean-token-sum-norm; export.verl_version=0.9.1 has it",
        ),
        (
            ["estimator=forward_kl_topk", "estimator.use_chunked_topk=true"],
            "estimator.use_chunked_topk=True: verl 0.8.0 has no distillation.distillation_loss.use_chunked_topk "
            "(new in verl 0.9.0); export.verl_version=0.9.1 has it, or set estimator.use_chunked_topk=False",
        ),
    ],
)
def test_what_only_0_9_has_is_refused_for_0_8_0_in_one_line(tmp_path, extra, message):
    with pytest.raises(MiniverlError) as info:
        export(compose_config([*RECIPE, "export.verl_version=0.8.0", *extra]), tmp_path / "verl", cwd=ROOT)
    assert str(info.value) == message
    assert not (tmp_path / "verl").exists()


def test_the_0_8_0_export_says_in_one_line_what_per_micro_batch_normalisation_does_to_the_scale(tmp_path):
    two_chunks = [*RECIPE, "recipe.logical_batch=8", "hardware.update_chunk=2"]  # 4 micro-batches per GPU
    old = export(compose_config([*two_chunks, "export.verl_version=0.8.0"]), tmp_path / "old", cwd=ROOT)
    (line,) = [w for w in old.warnings if "#7200" in w]
    assert "splits each GPU's 8 rows into 4 micro-batches of 2" in line and "previous update's" in line
    assert "export.ppo_micro_batch_size_per_gpu=8" in line and "\n" not in line
    assert line in (old.folder / "README.md").read_text()
    new = export(compose_config(two_chunks), tmp_path / "new", cwd=ROOT)
    assert not any("#7200" in w for w in new.warnings)
    one = export(
        compose_config([*two_chunks, "export.verl_version=0.8.0", "export.ppo_micro_batch_size_per_gpu=8"]),
        tmp_path / "one",
        cwd=ROOT,
    )
    assert not any("#7200" in w for w in one.warnings)  # one micro-batch: the scale is the same


def test_the_teacher_temperature_rule_is_each_releases(tmp_path):
    lines = export(compose_config(RECIPE), tmp_path / "verl", cwd=ROOT).lines
    cfg = OmegaConf.to_container(compose_verl(verl_tree("0.9.1"), lines), resolve=True)
    cfg["distillation"]["teacher_models"]["teacher_model"]["inference"]["temperature"] = 0.7
    assert runtime_violations(cfg, "0.9.1") == []  # 0.9 warns and forces 1.0 (#6867)
    assert any("temperature=0.7 must be 1.0" in p for p in runtime_violations(cfg, "0.8.0"))  # 0.8 refuses


# ---------------------------------------------------------------- the import, for either release


EXAMPLE_0_9 = """#!/usr/bin/env bash
# In the shape of verl 0.9's examples/on_policy_distillation_trainer/run_qwen3_5_4b_fsdp.sh
set -xeuo pipefail
STUDENT_MODEL=${STUDENT_MODEL:-Qwen/Qwen3-0.6B}
TEACHER_MODEL=${TEACHER_MODEL:-Qwen/Qwen3-8B}
max_num_tokens=$(( 512 + 1024 + 1 ))
ACTOR=(
    actor_rollout_ref.actor.optim.lr=1e-6
    actor_rollout_ref.actor.ppo_mini_batch_size=64
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1
    actor_rollout_ref.actor.strategy=fsdp2
    actor_rollout_ref.actor.fsdp_config.param_offload=True
    actor_rollout_ref.actor.loss_agg_mode=token-sum
)
REF=(
    actor_rollout_ref.ref.strategy=fsdp2
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=1
)
EXTRA=(
    distillation.enabled=True
    distillation.n_gpus_per_node=8
    distillation.nnodes=1
    distillation.teacher_models.teacher_model.model_path="$TEACHER_MODEL"
    distillation.teacher_models.teacher_model.inference.tensor_model_parallel_size=8
    distillation.teacher_models.teacher_model.inference.expert_parallel_size=8
    distillation.teacher_models.teacher_model.inference.temperature=0.6
    distillation.teacher_models.teacher_model.inference.max_model_len=${max_num_tokens}
    distillation.distillation_loss.loss_mode=forward_kl_topk
    distillation.distillation_loss.topk=64
    distillation.distillation_loss.use_policy_gradient=False
    +distillation.distillation_loss.use_chunked_topk=True
)
python3 -m verl.trainer.main_ppo \\
    data.train_files="['$HOME/data/gsm8k/train.parquet']" \\
    data.train_batch_size=64 \\
    algorithm.adv_estimator=grpo \\
    actor_rollout_ref.model.path="$STUDENT_MODEL" \\
    actor_rollout_ref.model.lora_rank=32 \\
    actor_rollout_ref.model.use_remove_padding=True \\
    actor_rollout_ref.rollout.name=vllm \\
    algorithm.use_kl_in_reward=False \\
    trainer.total_training_steps=10 \\
    trainer.balance_batch=True \\
    "${ACTOR[@]}" "${REF[@]}" "${EXTRA[@]}" "$@" |& tee logs/opd-$(date +%Y%m%d).log
"""


def test_a_0_9_launch_imports_its_new_keys_and_lists_engine_settings_apart(tmp_path):
    script = tmp_path / "run_opd.sh"
    script.write_text(EXAMPLE_0_9)
    text = import_verl.import_file(script, env={"HOME": "/home/user"})  # verl 0.9.1 by default
    values = parsed([line for line in text.splitlines() if line and not line.startswith("#")])
    assert values["export.verl_version"] == "0.9.1"
    assert values["estimator.loss_agg_mode"] == "token-sum" and values["estimator.use_chunked_topk"] is True
    assert values["estimator.loss_mode"] == "forward_kl_topk" and values["model.lora.r"] == 32
    not_imported, engine = text.split("# verl engine settings")
    assert "tee" not in text and "2>&1" not in text  # the shell's pipe and redirection end the command
    assert "inference.temperature" not in not_imported  # 0.9 forces the teacher's temperature to 1.0
    assert "-- no miniverl field" not in not_imported  # every key is imported, or engine mechanics
    assert "use_kl_in_reward" not in text  # off: what miniverl does
    for key in ("actor.strategy=fsdp2", "ref.log_prob_micro_batch_size_per_gpu=1", "expert_parallel_size=8",
                "use_remove_padding=True", "trainer.balance_batch=True", "fsdp_config.param_offload=True"):  # fmt: skip
        assert key in engine, key
    old = import_verl.import_file(script, env={"HOME": "/home/user"}, version="0.8.0")
    assert "inference.temperature=0.6  -- miniverl means 1.0" in old  # 0.8.0 would refuse it
    assert "loss_agg_mode=token-sum  -- not a loss_agg_mode of verl 0.8.0" in old
    assert "estimator.loss_agg_mode" not in old
    assert "use_chunked_topk=True  -- verl 0.8.0 has no such key (new in verl 0.9.0)" in old
    assert "estimator.use_chunked_topk" not in old


@pytest.mark.slow
def test_the_0_9_1_export_import_export_is_a_fixed_point(tmp_path):
    launch = LAUNCHES["forward_kl_topk_chunked"] + ["estimator.loss_agg_mode=token-sum"]
    first = export(compose_config(launch), tmp_path / "verl", cwd=ROOT)
    text = import_verl.import_file(tmp_path / "verl" / "overrides.txt")
    back = [line for line in text.splitlines() if line and not line.startswith("#")]
    again = export(compose_config([*RECIPE, *back]), tmp_path / "again", cwd=ROOT)
    assert [line.replace("/again/", "/verl/") for line in again.lines] == first.lines
    assert f"{TEACHER}.inference.temperature=1.0" in first.lines


def test_reward_kwargs_of_the_users_function_export_and_import_back(tmp_path, tree, raw_default):
    fn = tmp_path / "my_reward.py"
    fn.write_text("def my_score(data_source, solution_str, ground_truth, extra_info=None, **kw):\n    return 1.0\n")
    launch = [
        "+recipe=opd_k1_grpo_toy",
        f"reward.custom_reward_function.path={fn}",
        "reward.custom_reward_function.name=my_score",
        "+reward.custom_reward_function.reward_kwargs.format_score=0.1",
    ]
    result = export(compose_config(launch), tmp_path / "verl", cwd=ROOT)
    assert "+reward.custom_reward_function.reward_kwargs={format_score:0.1}" in result.lines
    verl_cfg = compose_verl(tree, result.lines)  # verl's YAML has no such key: "+" adds it
    assert OmegaConf.select(verl_cfg, "reward.custom_reward_function.reward_kwargs") == {"format_score": 0.1}
    assert type_errors(tree, raw_default, result.lines) == []
    text = import_verl.import_file(tmp_path / "verl" / "overrides.txt")
    assert "++reward.custom_reward_function.reward_kwargs.format_score=0.1" in text.splitlines()
    # A launch that adds one entry the way verl's examples add free-form keys reads the same.
    lines = [line for line in result.lines if "reward_kwargs" not in line]
    lines.append("+reward.custom_reward_function.reward_kwargs.format_score=0.1")
    mapped, _ = import_verl.to_miniverl(lines)
    assert dict(mapped)["reward.custom_reward_function.reward_kwargs"] == {"format_score": 0.1}
    own = export(compose_config(launch[:1] + launch[3:]), tmp_path / "own", cwd=ROOT)  # the export's own scorer
    assert "+reward.custom_reward_function.reward_kwargs={}" in own.lines  # takes no keyword arguments


def test_the_import_reads_a_launch_for_the_release_the_export_wrote_it_for(tmp_path):
    export(compose_config([*RECIPE, "export.verl_version=0.8.0"]), tmp_path / "old", cwd=ROOT)
    for name in ("overrides.txt", "run_opd.sh"):  # field_rules.json beside it, or the script's header
        assert "export.verl_version=0.8.0" in import_verl.import_file(tmp_path / "old" / name).splitlines()
    (tmp_path / "old" / "field_rules.json").unlink()
    assert "export.verl_version=0.8.0" in import_verl.import_file(tmp_path / "old" / "run_opd.sh").splitlines()
    script = tmp_path / "old" / "run_opd.sh"
    assert "export.verl_version=0.9.1" in import_verl.import_file(script, version="0.9.1").splitlines()


def test_a_launch_read_as_another_release_than_its_header_says_so_in_the_text_and_on_the_console(tmp_path, capsys):
    """A new-user audit read an export for verl 0.8.0 with --verl-version 0.9.1: converted without a word."""
    from miniverl.import_verl import main

    export(compose_config([*RECIPE, "export.verl_version=0.8.0"]), tmp_path / "old", cwd=ROOT)
    script = tmp_path / "old" / "run_opd.sh"
    note = (
        f"{script} was written for verl 0.8.0 (miniverl's export) and is read as verl 0.9.1 (--verl-version): "
        "0.9.1's defaults fill what it leaves out; leave --verl-version out to read it as written"
    )
    assert main([str(script), "--verl-version", "0.9.1", "-o", str(tmp_path / "read.txt")]) == 0
    assert capsys.readouterr().err == f"miniverl: warning: {note}\n"
    assert f"# note: {note}" in (tmp_path / "read.txt").read_text().splitlines()
    for same in (["--verl-version", "0.8.0"], []):  # as written: no note
        assert main([str(script), *same]) == 0
        printed = capsys.readouterr()
        assert printed.err == "" and "# note:" not in printed.out


def test_a_teachers_block_of_one_exports_as_one_named_entry_without_routing(tmp_path, tree):
    one = [*RECIPE, "+teacher@teachers.only=qwen3_1_7b", "teachers.only.key=openai/gsm8k"]
    result = export(compose_config(one), tmp_path / "verl", cwd=ROOT)
    assert not any(line.startswith("distillation.teacher_key=") for line in result.lines)
    assert "+distillation.teacher_models.only.key=openai/gsm8k" in result.lines
    resolved = OmegaConf.to_container(compose_verl(tree, result.lines), resolve=True)
    assert runtime_violations(resolved, "0.9.1") == []  # verl drops teacher_model and serves `only` alone
    readme = (result.folder / "README.md").read_text()
    assert "the frozen teacher (" in readme and "routed by" not in readme


def test_the_0_8_0_export_with_task_rewards_says_its_dapo_rule_differs(tmp_path):
    old = export(compose_config(["+recipe=opd_k1_grpo_toy", "export.verl_version=0.8.0"]), tmp_path / "old", cwd=ROOT)
    assert any("math_dapo" in w and "\\boxed{}" in w for w in old.warnings)
    new = export(compose_config(["+recipe=opd_k1_grpo_toy"]), tmp_path / "new", cwd=ROOT)
    assert not any("math_dapo" in w for w in new.warnings)


@pytest.mark.parametrize("version", ["0.9.1", "0.8.0"])
def test_seq_mean_token_sum_norm_divides_by_the_response_limit_on_verl_too(tmp_path, version):
    """verl divides that mode by its padded response width without loss_scale_factor: max_response_length in
    0.8.0, but each micro-batch's longest response in 0.9.1's V1 trainer (a fidelity audit of 0.9.1's code).
    The export writes the divisor; the import says where a launch divides otherwise."""
    norm = [*RECIPE, "estimator.loss_agg_mode=seq-mean-token-sum-norm", f"export.verl_version={version}"]
    lines = export(compose_config(norm), tmp_path / "verl", cwd=ROOT).lines
    assert "actor_rollout_ref.actor.loss_scale_factor=64" in lines  # the recipe's response_limit
    token_mean = export(compose_config([*RECIPE, f"export.verl_version={version}"]), tmp_path / "tm", cwd=ROOT)
    assert not any("loss_scale_factor" in line for line in token_mean.lines)  # read by that mode alone
    notes = {}
    for name, edit in (("as written", None), ("left out", ""), ("another", "=100")):
        launch = [line if edit is None or "loss_scale_factor" not in line else line.split("=")[0] + edit
                  for line in lines if edit != "" or "loss_scale_factor" not in line]  # fmt: skip
        (tmp_path / f"{name}.txt").write_text("\n".join(launch) + "\n")
        text = import_verl.import_file(tmp_path / f"{name}.txt", version=version)
        notes[name] = [line for line in text.splitlines() if "loss_scale_factor" in line]
    assert notes["as written"] == []
    assert notes["another"] == [
        "#   actor_rollout_ref.actor.loss_scale_factor=100  -- verl divides by 100; miniverl's seq-mean-token-sum-norm "
        "by recipe.response_limit"
    ]
    longest = [
        "#   actor_rollout_ref.actor.loss_scale_factor=null  -- verl divides by each micro-batch's longest response; "
        "miniverl's seq-mean-token-sum-norm by recipe.response_limit"
    ]
    assert notes["left out"] == (longest if version == "0.9.1" else [])  # 0.8.0 pads to max_response_length


def test_the_launch_readme_names_what_to_install_for_its_release(tmp_path):
    """0.9.1's default trainer (trainer.use_v1) imports transfer_queue, which only verl's verl-core extra
    installs: a plain `pip install verl` stops there (a fidelity audit)."""
    for version, requirement in (("0.9.1", "verl[verl-core]==0.9.1"), ("0.8.0", "verl==0.8.0")):
        export(compose_config([*RECIPE, f"export.verl_version={version}"]), tmp_path / version, cwd=ROOT)
        assert f'`pip install "{requirement}" vllm`' in (tmp_path / version / "README.md").read_text()


def test_the_0_9_1_rollout_is_seeded_and_deterministic_as_the_run_is(tmp_path):
    """verl 0.9.1 added rollout.seed and rollout.full_determinism (vLLM's seed per request, batch-invariant
    kernels): the export writes trainer.seed and hardware.deterministic there too, 0.8.0's has no such keys
    (a fidelity audit: the 0.9.1 cluster sampled with seed 42 whatever trainer.seed said)."""
    settings = ["trainer.seed=7", "hardware.deterministic=false"]
    lines = export(compose_config([*RECIPE, *settings]), tmp_path / "new", cwd=ROOT).lines
    for key, value in (("seed", "7"), ("full_determinism", "False")):
        assert f"actor_rollout_ref.rollout.{key}={value}" in lines
        assert f"actor_rollout_ref.actor.fsdp_config.{key}={value}" in lines
    old = export(compose_config([*RECIPE, *settings, "export.verl_version=0.8.0"]), tmp_path / "old", cwd=ROOT)
    assert not any(
        line.startswith(("actor_rollout_ref.rollout.seed", "actor_rollout_ref.rollout.full_")) for line in old.lines
    )
