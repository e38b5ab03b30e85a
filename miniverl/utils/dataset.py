"""Prompts from verl-format parquet files (columns `data_source`, `prompt`, `ability`,
`reward_model`, `extra_info`; only the prompt column is needed, task rewards read
`data_source`, `reward_model.ground_truth` and `extra_info`, several teachers the `teacher_key`
column), read with pyarrow.

Each prompt (a list of {role, content} messages) goes through the tokenizer's chat template with
`add_generation_prompt=True`, as verl's RLHFDataset does. A prompt longer than
`recipe.prompt_limit` tokens is an error naming its row (verl's `truncation=error`), or is
dropped and counted when `data.filter_overlong_prompts=true`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from miniverl.config.data import DataConfig
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


def read_conversations(data: DataConfig, key: str = "train_files", route_column: str | None = None) -> Conversations:
    """All prompts of all files of `data.<key>`, in file order, and the digest of the input bytes;
    with `route_column` (several teachers' `teacher_key`) each row's value of that column too."""
    conversations, answers, tasks, routes, digests = [], [], [], [], []
    where = f"data.{key}"
    for name in getattr(data, key):
        path = Path(name)
        if not path.is_file():
            raise MiniverlError(f"{where}: {name} does not exist (paths are relative to {Path.cwd()})")
        try:
            table = pq.read_table(path)
        except (pa.ArrowException, OSError) as error:
            raise MiniverlError(f"{where}: {name} is not a readable parquet file ({error})") from None
        if data.prompt_key not in table.column_names:
            raise MiniverlError(
                f"{where}: {name} has no column {data.prompt_key!r} "
                f"(columns: {', '.join(table.column_names)}); set data.prompt_key"
            )
        prompts = table.column(data.prompt_key).to_pylist()
        if route_column is not None:
            if route_column not in table.column_names:
                raise MiniverlError(
                    f"{where}: {name} has no column {route_column!r}, which teacher_key routes rows by "
                    f"(columns: {', '.join(table.column_names)}); set teacher_key to one of them"
                )
            routes.extend(None if v is None else str(v) for v in table.column(route_column).to_pylist())
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
    if not conversations:
        raise MiniverlError(f"{where}: {', '.join(getattr(data, key))} holds no rows")
    digest = digests[0] if len(digests) == 1 else sha256_json(digests)
    return Conversations(conversations, answers, digest, tasks, routes)


def check_messages(messages, name: str, row: int, column: str, where: str = "data.train_files") -> list[dict]:
    if isinstance(messages, str):  # a plain-text prompt is a single user turn
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


def tokenize_prompts(source: Conversations, data: DataConfig, tokenizer, prompt_limit: int) -> PromptSet:
    kwargs = dict(data.apply_chat_template_kwargs)
    kept = PromptSet([], [], [], [], source.parquet_sha256, len(source.messages))
    for row, messages in enumerate(source.messages):
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kwargs)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) > prompt_limit:
            if not data.filter_overlong_prompts:
                raise MiniverlError(
                    f"data.train_files row {row}: prompt is {len(ids)} tokens, "
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
        raise MiniverlError(f"data: no prompt fits recipe.prompt_limit={prompt_limit}; raise it")
    if kept.dropped_overlong:
        log.warning(
            "data: dropped %d prompt(s) over recipe.prompt_limit=%d tokens (rows %s)",
            len(kept.dropped_overlong),
            prompt_limit,
            kept.dropped_overlong[:10],
        )
    return kept


def with_answers(messages: list[list[dict]], answers: list[str | None]) -> list[list[dict]]:
    """Prompt conversations completed with their ground truth: the toy teacher's pretraining text."""
    return [m + ([{"role": "assistant", "content": a}] if a is not None else []) for m, a in zip(messages, answers)]


def teacher_corpora(
    conversations: Conversations, keys: dict[str, str | None], default_teacher: str | None = None
) -> dict[str, list[list[dict]]]:
    """Each toy teacher's pretraining text by teacher name (`keys`: name -> its key): the rows it
    scores, completed with their ground truth. Without routes (one teacher) every row."""
    texts = with_answers(conversations.messages, conversations.answers)
    if not conversations.routes:
        return {name: texts for name in keys}
    by_key = {key: name for name, key in keys.items()}
    corpora: dict[str, list[list[dict]]] = {name: [] for name in keys}
    for text, value in zip(texts, conversations.routes):
        name = by_key.get(value, default_teacher)
        if name is not None:
            corpora[name].append(text)
    return corpora
