"""verl-format parquet input: the shipped toy set, a user's own file, several files, long prompts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from safetensors.torch import load_file

from miniverl.config import to_config
from miniverl.config.data import DataConfig
from miniverl.models.toy import build_toy_tokenizer
from miniverl.trainer.opd_trainer import OPDTrainer
from miniverl.utils.dataset import read_conversations, tokenize_prompts
from miniverl.utils.errors import MiniverlError
from miniverl.utils.identity import resolved_config

from conftest import ROOT, SHORT, compose_config

USER_ROWS = [
    ([("system", "Tu es un assistant précis."), ("user", "Combien font 1234 + 5678 ? Réponds en chiffres.")], "6912"),
    ([("system", "Answer with digits only."), ("user", "What is 250 × 12?")], "3000"),
    ([("user", "Berechne 99 − 17. 数字で答えて ✓")], "82"),
    ([("system", "Be brief."), ("user", "Is 1000003 prime?")], "yes"),
]


def write_user_parquet(path):
    """A verl-format file as another program might write it: other column order, an extra column."""
    prompt_type = pa.list_(pa.struct([("content", pa.string()), ("role", pa.string())]))
    table = pa.table(
        {
            "extra_info": pa.array(
                [{"index": i, "split": "train", "source_id": f"q{i:04d}"} for i in range(len(USER_ROWS))]
            ),
            "prompt": pa.array(
                [[{"content": c, "role": r} for r, c in msgs] for msgs, _ in USER_ROWS], type=prompt_type
            ),
            "data_source": ["user/arith"] * len(USER_ROWS),
            "reward_model": [{"ground_truth": gt, "style": "rule"} for _, gt in USER_ROWS],
            "ability": ["math"] * len(USER_ROWS),
            "difficulty": [1.5, 2.0, 0.5, 3.0],
        }
    )
    pq.write_table(table, path, compression="zstd", row_group_size=2)
    return path


def test_shipped_toy_prompts_are_what_the_committed_script_makes(tmp_path):
    out = tmp_path / "toy.parquet"
    subprocess.run([sys.executable, str(ROOT / "data/make_toy_prompts.py"), str(out)], check=True, capture_output=True)
    shipped = pq.read_table(ROOT / "data/toy_prompts.parquet")
    assert pq.read_table(out).to_pylist() == shipped.to_pylist()
    assert shipped.num_rows == 64
    assert set(shipped.column_names) == {"data_source", "prompt", "ability", "reward_model", "extra_info"}
    for name in ("toy_digit_sums.parquet", "toy_digit_sums_heldout.parquet"):  # the task-reward recipe's
        digits = pq.read_table(ROOT / "data" / name).to_pylist()
        assert pq.read_table(tmp_path / name).to_pylist() == digits
        assert all(len(r["reward_model"]["ground_truth"]) == 1 for r in digits)  # one digit: a toy can earn it
    for name in ("toy_mixed.parquet", "toy_mixed_heldout.parquet"):  # the two-teacher recipe's
        mixed = pq.read_table(ROOT / "data" / name).to_pylist()
        assert pq.read_table(tmp_path / name).to_pylist() == mixed
        sources = [r["data_source"] for r in mixed]
        assert sources[::2] == ["miniverl/toy_arithmetic"] * (len(mixed) // 2)
        assert sources[1::2] == ["miniverl/toy_echo"] * (len(mixed) // 2)


def test_a_users_verl_parquet_runs_unchanged(tmp_path):
    path = write_user_parquet(tmp_path / "mine.parquet")
    cfg = compose_config(
        ["+recipe=opd_k1", *SHORT, f"data.train_files={path}", "recipe.logical_batch=2", "recipe.optimizer_updates=2"]
    )
    trainer = OPDTrainer(to_config(cfg), resolved_config(cfg), tmp_path / "run")
    trainer.setup()
    trainer.train()
    trainer.finish()
    tokenizer = trainer.tokenizer
    for update, rows in ((1, [0, 1]), (2, [2, 3])):
        t = load_file(str(tmp_path / "run" / "trajectories" / f"update_{update:06d}.safetensors"))
        assert t["prompt_rows"].tolist() == rows
        for row, ids in zip(rows, t["prompts"]):
            text = tokenizer.decode(ids, skip_special_tokens=False).replace(tokenizer.pad_token, "")
            expected = tokenizer.apply_chat_template(
                [{"role": r, "content": c} for r, c in USER_ROWS[row][0]], add_generation_prompt=True, tokenize=False
            )
            assert text == expected  # unicode and multi-digit numbers survive tokenization


def test_several_train_files_are_read_in_order(tmp_path):
    path = write_user_parquet(tmp_path / "mine.parquet")
    config = to_config(compose_config([f"data.train_files=[{ROOT}/data/toy_prompts.parquet,{path}]"]))
    conversations = read_conversations(config.data)
    assert len(conversations.messages) == 64 + len(USER_ROWS)
    assert conversations.messages[64][0]["content"] == USER_ROWS[0][0][0][1]
    assert conversations.answers[65] == "3000"


def test_the_shipped_prompts_are_found_from_any_directory_and_a_users_file_of_that_name_wins(tmp_path, monkeypatch):
    from miniverl.config.data import DataConfig

    monkeypatch.chdir(tmp_path)  # outside the checkout: the recipes' default path is the shipped file
    shipped = read_conversations(DataConfig())
    assert len(shipped.messages) == 64
    assert shipped.parquet_sha256 == read_conversations(DataConfig([f"{ROOT}/data/toy_prompts.parquet"])).parquet_sha256

    (tmp_path / "data").mkdir()
    write_user_parquet(tmp_path / "data" / "toy_prompts.parquet")
    assert len(read_conversations(DataConfig()).messages) == len(USER_ROWS)

    with pytest.raises(MiniverlError) as refused:
        read_conversations(DataConfig("data/mine.parquet"))
    assert str(refused.value) == (
        f"data.train_files: data/mine.parquet does not exist (paths are relative to {tmp_path}, "
        f"or to {ROOT} for the prompts miniverl ships in data/)"
    )
    monkeypatch.chdir(ROOT)  # in the checkout itself the two folders are one, named once
    with pytest.raises(MiniverlError) as refused:
        read_conversations(DataConfig("data/mine.parquet"))
    assert str(refused.value).endswith(
        f"(paths are relative to {ROOT}, miniverl's checkout, whose data/ holds the prompts it ships)"
    )


def test_an_overlong_prompt_is_an_error_naming_its_row():
    config = to_config(compose_config(["recipe.prompt_limit=50"]))
    with pytest.raises(MiniverlError, match=r"row \d+: prompt is \d+ tokens, over recipe.prompt_limit=50"):
        tokenize_prompts(read_conversations(config.data), config.data, build_toy_tokenizer(), 50)


def test_overlong_prompts_are_dropped_and_counted_when_asked(caplog):
    config = to_config(compose_config(["data.filter_overlong_prompts=true"]))
    tokenizer = build_toy_tokenizer()
    conversations = read_conversations(config.data)
    lengths = [
        len(
            tokenizer(
                tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=False), add_special_tokens=False
            )["input_ids"]
        )
        for m in conversations.messages
    ]
    limit = sorted(lengths)[32]
    prompts = tokenize_prompts(conversations, config.data, tokenizer, limit)
    too_long = [row for row, n in enumerate(lengths) if n > limit]
    assert prompts.dropped_overlong == too_long and len(prompts) == 64 - len(too_long) > 0
    assert f"dropped {len(too_long)} prompt(s)" in caplog.text


def test_an_overlong_prompt_of_several_files_or_of_the_held_out_ones_is_named_by_its_file_and_row(tmp_path, caplog):
    """A new-user audit: row 8 "of data.train_files" was row 2 of the second file; an over-long held-out prompt
    was called a data.train_files row."""
    long_rows = [[{"role": "user", "content": "Repeat: " + "word " * 200}]] * 3
    pq.write_table(pa.table({"prompt": long_rows}), tmp_path / "long.parquet")
    shipped = f"{ROOT}/data/toy_prompts.parquet"
    config = to_config(compose_config([f"data.train_files=[{shipped},{tmp_path}/long.parquet]"]))
    with pytest.raises(MiniverlError) as refused:
        tokenize_prompts(read_conversations(config.data), config.data, build_toy_tokenizer(), 128)
    assert str(refused.value).startswith(f"data.train_files {tmp_path}/long.parquet row 0: prompt is ")
    config = to_config(compose_config([f"data.val_files={tmp_path}/long.parquet", "data.filter_overlong_prompts=true",
                                       f"data.train_files=[{shipped}]"]))  # fmt: skip
    with pytest.raises(MiniverlError, match=r"^data.val_files: no prompt fits recipe.prompt_limit=128"):
        tokenize_prompts(read_conversations(config.data, "val_files"), config.data, build_toy_tokenizer(), 128)
    config = to_config(compose_config([f"data.val_files={tmp_path}/long.parquet"]))
    with pytest.raises(MiniverlError, match=r"^data.val_files row 0: prompt is \d+ tokens"):
        tokenize_prompts(read_conversations(config.data, "val_files"), config.data, build_toy_tokenizer(), 128)
    files = f"data.train_files=[{shipped},{tmp_path}/long.parquet]"
    config = to_config(compose_config(["data.filter_overlong_prompts=true", files]))
    kept = tokenize_prompts(read_conversations(config.data), config.data, build_toy_tokenizer(), 128)
    assert kept.dropped_overlong == [64, 65, 66]  # the plan's rows count across the files
    said = f"{tmp_path}/long.parquet row 0, {tmp_path}/long.parquet row 1, {tmp_path}/long.parquet row 2"
    assert f"data.train_files: dropped 3 prompt(s) over recipe.prompt_limit=128 tokens ({said})" in caplog.text


def test_a_prompt_column_of_json_text_is_refused_and_plain_strings_are_one_user_message(tmp_path):
    """A message list saved as json.dumps text trained on the JSON itself; plain strings are miniverl's own
    convenience (verl reads lists), and a column picked by mistake is the same to the reader: the data check warns."""
    import json

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"}]
    pq.write_table(pa.table({"prompt": [json.dumps(messages)]}), tmp_path / "json.parquet")
    config = to_config(compose_config([f"data.train_files={tmp_path}/json.parquet"]))
    with pytest.raises(MiniverlError) as refused:
        read_conversations(config.data)
    assert str(refused.value) == (
        f"data.train_files: {tmp_path}/json.parquet row 0 column 'prompt' holds the JSON text of a message list, not "
        "the list: store the list itself (verl's format; e.g. df[column] = df[column].map(json.loads))"
    )
    pq.write_table(pa.table({"prompt": ["[1, 2] is a list", "What is 2 + 2?"]}), tmp_path / "plain.parquet")
    config = to_config(compose_config([f"data.train_files={tmp_path}/plain.parquet"]))
    conversations = read_conversations(config.data)
    assert conversations.messages[0] == [{"role": "user", "content": "[1, 2] is a list"}]
    assert conversations.plain_strings == 2
    assert read_conversations(to_config(compose_config([])).data).plain_strings == 0


def test_a_folder_of_parquet_files_is_named_a_folder_with_its_files_to_give(tmp_path):
    """A new-user audit gave data.train_files a folder of parquet files and read "does not exist"."""
    for name in ("a.parquet", "b.parquet"):
        pq.write_table(pa.table({"prompt": [[{"role": "user", "content": "1 + 1?"}]]}), tmp_path / name)
    config = to_config(compose_config([f"data.train_files={tmp_path}"]))
    with pytest.raises(MiniverlError) as refused:
        read_conversations(config.data)
    assert str(refused.value) == (
        f"data.train_files: {tmp_path} is a folder; give its files: "
        f"data.train_files=[{tmp_path}/a.parquet,{tmp_path}/b.parquet]"
    )


def test_a_file_without_the_prompt_column_is_an_error_naming_it(tmp_path):
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"question": ["What is 2 + 2?"]}), path)
    config = to_config(compose_config([f"data.train_files={path}"]))
    with pytest.raises(MiniverlError, match="has no column 'prompt'"):
        read_conversations(config.data)


def test_a_file_without_the_teacher_key_column_is_an_error_naming_it(tmp_path):
    path = tmp_path / "no_source.parquet"
    pq.write_table(pa.table({"prompt": [[{"role": "user", "content": "2 + 2?"}]]}), path)
    config = to_config(compose_config([f"data.train_files={path}"]))
    with pytest.raises(MiniverlError, match=r"has no column 'data_source', which teacher_key routes rows by"):
        read_conversations(config.data, route_column="data_source")
    assert read_conversations(config.data).routes == []  # one teacher reads no routing column


def test_only_a_data_path_falls_back_to_the_checkout(tmp_path, monkeypatch):
    from miniverl.utils.dataset import locate

    monkeypatch.chdir(tmp_path)
    assert locate("data/toy_prompts.parquet") == ROOT / "data" / "toy_prompts.parquet"
    assert locate("./data/toy_prompts.parquet") == Path("./data/toy_prompts.parquet")  # a path of the user's
    assert locate("conf/config.yaml") == Path("conf/config.yaml")


def test_a_json_lines_file_is_refused_with_the_pyarrow_line_that_converts_it(tmp_path):
    """A new-user audit gave its .jsonl and read only "Parquet magic bytes not found"."""
    rows = tmp_path / "prompts.jsonl"
    rows.write_text(
        '{"prompt": [{"role": "user", "content": "What is 2 + 2?"}], "data_source": "x"}\n'
        '{"prompt": [{"role": "user", "content": "Name a sea."}], "data_source": "x"}\n'
    )
    with pytest.raises(MiniverlError) as refused:
        read_conversations(DataConfig(train_files=[str(rows)]))
    convert = str(refused.value).split("miniverl reads parquet, as verl does: python -c ", 1)[1]
    subprocess.run([sys.executable, "-c", convert.strip('"')], check=True, cwd=tmp_path)
    read = read_conversations(DataConfig(train_files=[str(tmp_path / "prompts.parquet")]))
    assert read.messages[1] == [{"role": "user", "content": "Name a sea."}]


def test_a_teachers_context_goes_before_the_rows_system_message_and_rewrites_the_last_user_turn():
    """teacher.context: `system` first (before a row's own system message, after two newlines), `user` in
    place of the last user message only (a tests audit: every test row had one user turn and no system)."""
    from miniverl.config.teacher import TeacherContext
    from miniverl.utils.dataset import Conversations, teacher_conversations

    rows = [
        [{"role": "system", "content": "R"}, {"role": "user", "content": "a"}],
        [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}],
    ]
    source = Conversations(rows, [None, None], "", records=[{"hint": "h0"}, {"hint": "h1"}])
    context = TeacherContext(system="S {{ hint }}", user="{{ user }}!")
    assert teacher_conversations(source, context, "teacher") == [
        [{"role": "system", "content": "S h0\n\nR"}, {"role": "user", "content": "a!"}],
        [
            {"role": "system", "content": "S h1"},
            {"role": "user", "content": "a"},
            {"role": "assistant", "content": "b"},
            {"role": "user", "content": "c!"},
        ],
    ]


def test_the_chat_templates_keyword_arguments_reach_it():
    """data.apply_chat_template_kwargs (verl's: enable_thinking=false for Qwen3) are the template's variables
    (a tests audit dropped them; only a slow test noticed, by a memory figure)."""
    from miniverl.config.data import DataConfig
    from miniverl.models import toy
    from miniverl.utils.dataset import prompt_ids

    tokenizer = toy.build_toy_tokenizer()
    tokenizer.chat_template = "{% if enable_thinking is false %}/no_think {% endif %}" + tokenizer.chat_template
    messages = [{"role": "user", "content": "2+2?"}]
    plain = tokenizer.decode(prompt_ids(messages, DataConfig(), tokenizer))
    asked = tokenizer.decode(
        prompt_ids(messages, DataConfig(apply_chat_template_kwargs={"enable_thinking": False}), tokenizer)
    )
    assert asked == "/no_think " + plain
