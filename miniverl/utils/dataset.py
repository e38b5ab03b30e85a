"""Prompts from verl-format parquet files (columns `data_source`, `prompt`, `ability`,
`reward_model`, `extra_info`; only the prompt column is needed, task rewards read
`data_source`, `reward_model.ground_truth` and `extra_info`, several teachers the `teacher_key`
column), read with pyarrow.

Each prompt (a list of {role, content} messages; a plain string is one user message, which verl does
not take) goes through the tokenizer's chat template with
`add_generation_prompt=True`, as verl's RLHFDataset does. A prompt longer than
`recipe.prompt_limit` tokens is an error naming its row (verl's `truncation=error`), or is
dropped and counted when `data.filter_overlong_prompts=true`.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from jinja2 import TemplateError

from miniverl import CHECKOUT
from miniverl.config.data import DataConfig
from miniverl.config.teacher import TeacherContext
from miniverl.utils.errors import MiniverlError
from miniverl.utils.identity import sha256_file, sha256_json

log = logging.getLogger(__name__)


@dataclass
class PromptSet:
    """Tokenized prompts; `rows[i]` is the parquet row (0-based, across files in order) of `token_ids[i]`."""

    token_ids: list[list[int]]
    rows: list[int]
    messages: list[list[dict]]
    answers: list[str | None]
    parquet_sha256: str
    rows_in_files: int  # before dropping overlong prompts
    dropped_overlong: list[int] = field(default_factory=list)
    tasks: dict[int, TaskRow] = field(default_factory=dict)  # parquet row -> what its task reward reads
    routes: dict[int, str | None] = field(default_factory=dict)  # parquet row -> its teacher_key value
    _position: dict | None = field(default=None, repr=False, compare=False)  # row -> index, built on first use

    def __len__(self) -> int:
        return len(self.rows)

    def token_ids_of(self, rows) -> list[list[int]]:
        """The tokenized prompts of parquet rows (an index built once: the dataset may be large)."""
        if self._position is None or len(self._position) != len(self.rows):
            self._position = {row: i for i, row in enumerate(self.rows)}
        return [self.token_ids[self._position[r]] for r in rows]


@dataclass(frozen=True)
class TaskRow:
    """What a row's task reward is scored from (verl's reward manager reads the same columns)."""

    data_source: str | None
    ground_truth: Any  # reward_model.ground_truth as the parquet holds it (verl passes it unchanged)
    extra_info: dict | None


@dataclass
class Conversations:
    """The prompt column of every file, untokenized, with ground truths where present."""

    messages: list[list[dict]]
    answers: list[str | None]
    parquet_sha256: str
    tasks: list[TaskRow] = field(default_factory=list)
    routes: list[str | None] = field(default_factory=list)  # each row's route_column value, when asked
    records: list[dict] = field(default_factory=list)  # each row's every column, when asked (teacher contexts)
    key: str = "train_files"  # the data.<key> the rows were read from
    files: list[tuple[str, int]] = field(default_factory=list)  # (file as given, its rows), in order
    plain_strings: int = 0  # rows whose prompt is a plain string (one user message), not a message list

    def row_name(self, row: int) -> str:
        """`data.<key> row <r>`, or with several files `data.<key> <file> row <r>`: a row as the user finds it."""
        if len(self.files) < 2:
            return f"data.{self.key} row {row}"
        for name, rows in self.files:
            if row < rows:
                return f"data.{self.key} {name} row {row}"
            row -= rows
        raise IndexError(row)


def locate(name: str) -> Path:
    """A data file as given, relative to the working directory; failing that, for a `data/...` name, the
    file miniverl ships there (`data/toy_prompts.parquet`, the recipes' default) in its checkout, so that
    a recipe runs from any directory. A user's file at the same relative path wins."""
    path = Path(name)
    if path.is_file() or path.is_absolute() or not name.startswith("data/"):
        return path
    shipped = CHECKOUT / path
    return shipped if shipped.is_file() else path


def missing_line(key: str, name: str) -> str:
    if Path(name).is_dir():  # verl reads files: a folder of them is listed, not globbed
        inside = [str(p) for p in sorted(Path(name).glob("*.parquet"))]
        listed = f"give its files: data.{key}=[{','.join(inside[:3])}{',...' * (len(inside) > 3)}]"
        return f"data.{key}: {name} is a folder; " + (listed if inside else "give parquet files (it holds none)")
    where = f"{Path.cwd()}, or to {CHECKOUT} for the prompts miniverl ships in data/"
    if Path.cwd().resolve() == CHECKOUT.resolve():  # one folder: named once
        where = f"{CHECKOUT}, miniverl's checkout, whose data/ holds the prompts it ships"
    return f"data.{key}: {name} does not exist (paths are relative to {where})"


def count_rows(names: list[str]) -> int | None:
    """The rows of these parquet files, read from their footers; None where one cannot be read."""
    try:
        return sum(pq.ParquetFile(locate(name)).metadata.num_rows for name in names)
    except (OSError, ValueError):
        return None


def missing_data_file(data: DataConfig, keys: tuple[str, ...]) -> str | None:
    """The line for the first file of `data.<key>` (each of `keys`) that is not there, or None."""
    missing = [(key, name) for key in keys for name in getattr(data, key) if not locate(name).is_file()]
    return missing_line(*missing[0]) if missing else None


def read_conversations(
    data: DataConfig, key: str = "train_files", route_column: str | None = None, with_records: bool = False
) -> Conversations:
    """All prompts of all files of `data.<key>`, in file order, and the digest of the input bytes;
    with `route_column` (several teachers' `teacher_key`) each row's value of that column too, and
    `with_records` each row's every column (what a teacher context reads)."""
    conversations, answers, tasks, routes, records, digests, files = [], [], [], [], [], [], []
    where, plain = f"data.{key}", 0
    for name in getattr(data, key):
        path = locate(name)
        if not path.is_file():
            raise MiniverlError(missing_line(key, name))
        try:
            table = pq.read_table(path)
        except (pa.ArrowException, OSError) as error:
            convert = (  # verl's data is parquet; JSON lines convert with pyarrow, which miniverl has
                f'; miniverl reads parquet, as verl does: python -c "import pyarrow.json as j, pyarrow.parquet as q; '
                f"q.write_table(j.read_json('{name}'), '{Path(name).with_suffix('.parquet')}')\""
                if Path(name).suffix in (".jsonl", ".json")
                else ""
            )
            raise MiniverlError(f"{where}: {name} is not a readable parquet file ({error}){convert}") from None
        if data.prompt_key not in table.column_names:
            raise MiniverlError(
                f"{where}: {name} has no column {data.prompt_key!r} "
                f"(columns: {', '.join(table.column_names)}); set data.prompt_key"
            )
        prompts = table.column(data.prompt_key).to_pylist()
        if with_records:
            records.extend(table.to_pylist())
        if route_column is not None:
            if route_column not in table.column_names:
                raise MiniverlError(
                    f"{where}: {name} has no column {route_column!r}, which teacher_key routes rows by "
                    f"(columns: {', '.join(table.column_names)}); set teacher_key to one of them"
                )
            values = table.column(route_column).to_pylist()
            if any(isinstance(v, (dict, list)) for v in values):
                raise MiniverlError(
                    f"{where}: {name} column {route_column!r} holds lists or structs; teacher_key routes by a "
                    "column of strings or numbers (e.g. data_source)"
                )
            routes.extend(None if v is None else str(v) for v in values)
        truths, sources, extras = (
            table.column(key).to_pylist() if key in table.column_names else [None] * len(prompts)
            for key in ("reward_model", "data_source", "extra_info")
        )
        for row, messages in enumerate(prompts):
            conversations.append(check_messages(messages, name, row, data.prompt_key, where))
            truth = truths[row]
            answers.append(
                str(truth["ground_truth"])
                if isinstance(truth, dict) and truth.get("ground_truth") is not None
                else None
            )
            extra = extras[row] if isinstance(extras[row], dict) else None
            raw = truth.get("ground_truth") if isinstance(truth, dict) else None
            tasks.append(TaskRow(None if sources[row] is None else str(sources[row]), raw, extra))
        digests.append(sha256_file(path))
        files.append((name, len(prompts)))
        plain += sum(isinstance(p, str) for p in prompts)
    if not conversations:
        raise MiniverlError(f"{where}: {', '.join(getattr(data, key))} holds no rows")
    digest = digests[0] if len(digests) == 1 else sha256_json(digests)
    return Conversations(conversations, answers, digest, tasks, routes, records, key, files, plain)


def check_messages(messages, name: str, row: int, column: str, where: str = "data.train_files") -> list[dict]:
    if isinstance(messages, str):  # a plain-text prompt is a single user turn (miniverl's; verl reads lists)
        if json_message_list(messages):
            raise MiniverlError(
                f"{where}: {name} row {row} column {column!r} holds the JSON text of a message list, not the list: "
                "store the list itself (verl's format; e.g. df[column] = df[column].map(json.loads))"
            )
        return [{"role": "user", "content": messages}]
    ok = (
        isinstance(messages, list)
        and messages
        and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages
        )
    )
    if not ok:
        raise MiniverlError(
            f"{where}: {name} row {row} column {column!r}: expected a list of "
            "{role, content} messages (verl's format), got " + repr(messages)[:80]
        )
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def json_message_list(text: str) -> bool:
    """Whether a string is a message list serialised as JSON (`json.dumps` of verl's prompt column)."""
    if not text.lstrip().startswith("["):
        return False
    try:
        value = json.loads(text)
    except ValueError:
        return False
    return isinstance(value, list) and bool(value) and all(isinstance(m, dict) and "role" in m for m in value)


def prompt_ids(messages: list[dict], data: DataConfig, tokenizer, row_name: str = "a prompt") -> list[int]:
    """A conversation through the chat template with the generation prompt (verl's RLHFDataset); one the
    template refuses (Gemma's and Mistral's take no system turn) is the one line of `row_name`."""
    kwargs = dict(data.apply_chat_template_kwargs)
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kwargs)
    except TemplateError as error:
        roles = "/".join(m.get("role", "?") for m in messages)
        raise MiniverlError(
            f"{row_name}: the chat template refuses this conversation ({roles}): {error}; write the rows as the "
            "model's template takes them (without a system turn, say), or give the model another template"
        ) from None
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def tokenize_prompts(source: Conversations, data: DataConfig, tokenizer, prompt_limit: int) -> PromptSet:
    kept = PromptSet([], [], [], [], source.parquet_sha256, len(source.messages))
    for row, messages in enumerate(source.messages):
        ids = prompt_ids(messages, data, tokenizer, source.row_name(row))
        if len(ids) > prompt_limit:
            if not data.filter_overlong_prompts:
                raise MiniverlError(
                    f"{source.row_name(row)}: prompt is {len(ids)} tokens, "
                    f"over recipe.prompt_limit={prompt_limit}; raise the limit or set "
                    "data.filter_overlong_prompts=true to drop such prompts"
                )
            kept.dropped_overlong.append(row)
            continue
        kept.token_ids.append(ids)
        kept.rows.append(row)
        kept.messages.append(messages)
        kept.answers.append(source.answers[row])
        if source.tasks:
            kept.tasks[row] = source.tasks[row]
        if source.routes:
            kept.routes[row] = source.routes[row]
    if not kept.rows:  # the error alone, without the warning that would say the same first
        raise MiniverlError(f"data.{source.key}: no prompt fits recipe.prompt_limit={prompt_limit}; raise it")
    if kept.dropped_overlong:
        log.warning(
            "data.%s: dropped %d prompt(s) over recipe.prompt_limit=%d tokens (%s)",
            source.key,
            len(kept.dropped_overlong),
            prompt_limit,
            ", ".join(source.row_name(row).removeprefix(f"data.{source.key} ") for row in kept.dropped_overlong[:10]),
        )
    return kept


def teacher_conversations(
    source: Conversations, context: TeacherContext, where: str, files: str = "data.train_files"
) -> list[list[dict]]:
    """Each row's conversation as a teacher with a privileged context sees it: `context.system`
    first (before the row's own system message, if any), the last user message replaced by
    `context.user`; both Jinja templates over the row's columns and `user` (its last user message).
    A field the row does not have is one line naming the row and the field."""
    import jinja2

    env = jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
    templates = {n: env.from_string(t) for n in ("system", "user") if (t := getattr(context, n)) is not None}
    out = []
    for row, (messages, record) in enumerate(zip(source.messages, source.records)):
        users = [i for i, m in enumerate(messages) if m["role"] == "user"]
        if not users:
            raise MiniverlError(f"{files} row {row}: no user message for {where}.context to rewrite")
        values = {**record, "user": messages[users[-1]]["content"]}
        rendered = {}
        for name, template in templates.items():
            try:
                rendered[name] = template.render(values)
            except jinja2.UndefinedError as error:
                raise MiniverlError(
                    f"{where}.context.{name}: {files} row {row}: {error.message} "
                    f"(the row's fields: {', '.join(values)})"
                ) from None
        conversation = [dict(m) for m in messages]
        if "user" in rendered:
            conversation[users[-1]] = {"role": "user", "content": rendered["user"]}
        if "system" in rendered:
            if conversation[0]["role"] == "system":
                conversation[0] = {
                    "role": "system",
                    "content": rendered["system"] + "\n\n" + conversation[0]["content"],
                }
            else:
                conversation.insert(0, {"role": "system", "content": rendered["system"]})
        out.append(conversation)
    return out


def teacher_prompt_ids(
    conversations: list[list[dict]], rows: list[int], data: DataConfig, tokenizer, limit: int, where: str, files: str
) -> dict[int, list[int]]:
    """parquet row -> the teacher's prompt token ids, for the rows the student keeps; a prompt over
    `limit` tokens is an error naming its row."""
    out = {}
    for row in rows:
        ids = prompt_ids(conversations[row], data, tokenizer, f"{files} row {row} ({where}'s prompt)")
        if len(ids) > limit:
            raise MiniverlError(
                f"{files} row {row}: {where}'s prompt (with its context) is {len(ids)} tokens, over its "
                f"limit of {limit}; raise {where}.context.prompt_limit (null: recipe.prompt_limit)"
            )
        out[row] = ids
    return out


def with_answers(messages: list[list[dict]], answers: list[str | None]) -> list[list[dict]]:
    """Prompt conversations completed with their ground truth: the toy teacher's pretraining text."""
    return [m + ([{"role": "assistant", "content": a}] if a is not None else []) for m, a in zip(messages, answers)]


def teacher_corpora(
    conversations: Conversations,
    keys: dict[str, str | None],
    default_teacher: str | None = None,
    seen: dict[str, list[list[dict]]] | None = None,
) -> dict[str, list[list[dict]]]:
    """Each toy teacher's pretraining text by teacher name (`keys`: name -> its key): the rows it
    scores, as it sees them (`seen[name]`: its own conversations, with a context; else the
    student's), completed with their ground truth. Without routes (one teacher) every row."""
    texts = {name: with_answers((seen or {}).get(name, conversations.messages), conversations.answers) for name in keys}
    if not conversations.routes:
        return texts
    by_key = {key: name for name, key in keys.items()}
    corpora: dict[str, list[list[dict]]] = {name: [] for name in keys}
    for row, value in enumerate(conversations.routes):
        name = by_key.get(value, default_teacher)
        if name is not None:
            corpora[name].append(texts[name][row])
    return corpora
