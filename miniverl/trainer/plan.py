"""The compiled plan: the resolved config turned into explicit, frozen per-update decisions.

Everything a run does that could differ between two runs of the same experiment is fixed here:
which prompts each update consumes, the seed of every sample's sampling stream, the physical
batch sizes, the interrupt point and the estimator settings. `plan.json` is its canonical form
and `compiled_plan_sha256` its digest. Run-control settings (names, loggers, where to resume
from) are not part of it, so they never change the digest.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch

from miniverl import __version__
from miniverl.config import MiniverlConfig
from miniverl.models import cpu_gemm, tokenizers
from miniverl.models import loading as models
from miniverl.utils.dataset import (
    Conversations,
    PromptSet,
    locate,
    read_conversations,
    teacher_conversations,
    teacher_corpora,
    teacher_prompt_ids,
)
from miniverl.utils.device import wants_cuda
from miniverl.utils.downshift import split
from miniverl.utils.errors import MiniverlError
from miniverl.utils.identity import FOLDER_DIGESTS, model_folder_digest, sha256_file, sha256_json
from miniverl.workers.rollout.lean_decode import resolved_decode_settings

PLAN_VERSION = 1


def derive_seed(*parts: object) -> int:
    """A 63-bit seed from the run seed and counters (stable across processes and machines)."""
    return int(sha256_json([str(p) for p in parts])[:16], 16) >> 1


@dataclass(frozen=True)
class UpdatePlan:
    update: int  # 1-based optimizer update number
    prompt_rows: tuple[int, ...]  # parquet rows of the update's prompts
    sample_rows: tuple[int, ...]  # the parquet row of each sample, in batch order: rollout.n per prompt, adjacent
    sample_seeds: tuple[int, ...]  # one sampling stream per sample
    rollout_physical_batches: tuple[int, ...]
    update_chunks: tuple[int, ...]
    sample_teachers: tuple[str, ...] = ()  # several teachers: the one that scores each sample; else empty


@dataclass(frozen=True)
class Plan:
    version: int
    settings: dict  # every config field that shapes the experiment (see experiment_settings)
    input_parquet_sha256: str
    prompts_available: int
    interrupt_after_updates: int | None  # recipe.resume_check_after: where the resume check stops its first run
    updates: tuple[UpdatePlan, ...]

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @property
    def digest(self) -> str:
        return sha256_json(self.to_dict())

    @property
    def digest_before_folder_digests(self) -> str:
        """The digest of this plan without its local folders' digests, as plans were before they held
        them (2026-12-06): a checkpoint written then still resumes, unchecked for its folders."""
        plain = self.to_dict()
        for block in settings_model_blocks(plain["settings"]):
            block.pop(FOLDER_DIGESTS, None)
        return sha256_json(plain)

    def epoch_of(self, update: int) -> int:
        """The pass over the prompts that update `update` (1-based) takes its batch from, 0-based as verl's
        training/epoch: whole batches a pass (prompt_order)."""
        return (update - 1) // batches_per_pass(self.prompts_available, len(self.updates[0].prompt_rows))

    @property
    def prompts_consumed(self) -> int:
        return self.task_cursor(len(self.updates))

    def task_cursor(self, updates_done: int) -> int:
        """How many prompts the first `updates_done` updates consume (where a resume goes on)."""
        return sum(len(u.prompt_rows) for u in self.updates[:updates_done])


# The settings of a model block that may name a local folder: each such folder's digest enters the plan under
# the block's FOLDER_DIGESTS (utils/identity.model_folder_digest), which is not a config key.
FOLDER_KEYS = ("model_id", "tokenizer_id", "adapter")


def local_inputs(cfg: MiniverlConfig) -> list[tuple[str, Path]]:
    """Every local file or folder the run reads, with the setting that names it: the models', tokenizers' and
    adapters' folders, the data files, the task-reward function."""
    inputs = []
    for name, block in [("model", cfg.model), *((cfg.teacher_where(n), b) for n, b in cfg.teacher_blocks.items())]:
        for key in FOLDER_KEYS:
            if (value := getattr(block, key)) and value != "toy" and Path(value).expanduser().exists():
                inputs.append((f"{name}.{key}", Path(value).expanduser()))
    for key in ("train_files", "val_files"):
        inputs += [(f"data.{key}", locate(n)) for n in getattr(cfg.data, key) if locate(n).exists()]
    if (custom := cfg.reward.custom_reward_function.path) and Path(custom).exists():
        inputs.append(("reward.custom_reward_function.path", Path(custom)))
    return inputs


def settings_model_blocks(settings: dict) -> list[dict]:
    """The model blocks of plan settings: the student's and each teacher's."""
    blocks = [settings["model"], settings.get("teacher"), *settings.get("teachers", {}).values()]
    return [block for block in blocks if block is not None]


def experiment_settings(cfg: MiniverlConfig) -> dict:
    """The config minus run control (names, loggers, checkpoints, resume, export) and minus file
    paths (the data enters the plan by content digest)."""
    settings = dataclasses.asdict(cfg)
    settings["trainer"] = {"seed": cfg.trainer.seed}
    settings.pop("export")  # how a recipe would scale out on verl does not change this run
    settings.pop("eval")  # measuring progress on held-out prompts does not change training
    settings["data"].pop("val_files")
    settings["data"].pop("train_files")
    settings["hardware"].pop("name")
    settings["hardware"].pop("nf4_cache")  # where the same NF4 bits are read from
    if not wants_cuda(cfg.hardware):
        # A null means "by the CPU": the plan holds what this CPU resolves it to. A resume on a CPU of
        # another kind is refused for its kernels first (utils/numerics.refused_numerics); with
        # trainer.resume_inexact, as another plan until the command pins the products it began with.
        settings["hardware"]["cpu_float32_gemm"] = cpu_gemm.enabled_for(cfg.hardware, torch.device("cpu"))
        settings["hardware"].update(resolved_decode_settings(cfg.hardware))
    if cfg.teachers:  # the single `teacher` block is not read
        settings.pop("teacher")
    else:
        settings.pop("teachers")
    for block in [settings.get("teacher"), *settings.get("teachers", {}).values()]:
        if block is not None and block["unwritable_byte_log_prob"] is None:  # unset: the plans made before it
            block.pop("unwritable_byte_log_prob")
    if not cfg.routed:  # one teacher scores every row: nothing routes
        for unread in ("teacher_key", "default_teacher"):
            settings.pop(unread)
    for block in settings_model_blocks(settings):
        # A local folder's files are part of the experiment too: weights saved again there are another plan
        # (utils/resume_from.edited_files: a refused resume names the folder). A hub id is pinned by its revision.
        folders = {key: block[key] for key in FOLDER_KEYS if block.get(key) and block[key] != "toy"}
        digests = {key: model_folder_digest(path) for key, path in folders.items() if Path(path).expanduser().is_dir()}
        if digests:
            block[FOLDER_DIGESTS] = digests
    custom = cfg.reward.custom_reward_function
    if cfg.estimator.use_task_rewards and custom.path and Path(custom.path).is_file():
        # The function's code is part of the experiment, like the data: an edited file is another plan
        # (resume_from.REWARD_FUNCTION_DIGEST: a refused resume names the file).
        settings["reward"]["custom_reward_function"]["sha256"] = sha256_file(Path(custom.path))
    return settings


def read_rows(cfg: MiniverlConfig, key: str = "train_files") -> Conversations:
    """The rows of `data.<key>` with what the run's teachers read of them (routing, contexts)."""
    return read_conversations(cfg.data, key, route_column(cfg), with_records=uses_context(cfg))


def route_column(cfg: MiniverlConfig) -> str | None:
    """The data column several teachers are routed by (None with one teacher)."""
    return cfg.teacher_key if cfg.routed else None


def teacher_routes(
    cfg: MiniverlConfig, values: dict[int, str | None], where: str = "data.train_files"
) -> dict[int, str]:
    """parquet row -> the name of the teacher that scores it, from each row's teacher_key value
    (verl's routing); a row whose value matches no key goes to default_teacher, or is refused
    naming the row. Empty with one teacher (`teacher`, or a `teachers` block of one)."""
    if not cfg.routed:
        return {}
    by_key = {teacher.key: name for name, teacher in cfg.teachers.items()}
    routes = {}
    for row, value in values.items():
        name = by_key.get(value, cfg.default_teacher)
        if name is None:
            keys = ", ".join(f"{n}: {t.key!r}" for n, t in cfg.teachers.items())
            if value is None:
                raise MiniverlError(
                    f"{where} row {row}: no {cfg.teacher_key} (null), so no teacher's key ({keys}) matches; "
                    "fill it in the data or set default_teacher=<name>"
                )
            raise MiniverlError(
                f"{where} row {row}: {cfg.teacher_key}={value!r} matches no teacher's key ({keys}); add a "
                f"teacher for it (+teacher@teachers.<name>=<option> teachers.<name>.key={value}) or set "
                "default_teacher=<name>"
            )
        routes[row] = name
    return routes


def uses_context(cfg: MiniverlConfig) -> bool:
    """A teacher with a privileged context reads every column of the rows."""
    return any(t.context.enabled for t in cfg.teacher_blocks.values())


def teacher_contexts(
    cfg: MiniverlConfig, conversations: Conversations, rows: list[int], tokenizer, where: str = "data.train_files"
) -> dict[str, dict[int, list[int]]]:
    """teacher name -> parquet row -> that teacher's own prompt ids, for the teachers with a
    context (rendered for every kept row, so a missing field or an overlong prompt is found before
    any model loads)."""
    out = {}
    for name, block in cfg.teacher_blocks.items():
        teacher = cfg.teacher_where(name)
        limit = block.context.prompt_limit or cfg.recipe.prompt_limit
        if block.context.enabled:
            messages = teacher_conversations(conversations, block.context, teacher, where)
            out[name] = teacher_prompt_ids(messages, rows, cfg.data, tokenizer, limit, teacher, where)
        elif (own := aligned_teacher_tokenizer(block, teacher, tokenizer)) is not None:  # its own chat template
            out[name] = teacher_prompt_ids(conversations.messages, rows, cfg.data, own, limit, teacher, where)
    return out


def aligned_teacher_tokenizer(block, where: str, student_tokenizer):
    """The tokenizer of a teacher that scores text (tokenizer_alignment=text) when it differs from
    the student's; None otherwise (the teacher then scores the student's own ids)."""
    if not block.text_aligned:
        return None
    own = models.load_tokenizer(where, block, models.source_of(block, None))
    return own if tokenizers.tokenizers_differ(student_tokenizer, own) else None


def toy_teacher_corpora(cfg: MiniverlConfig, conversations: Conversations) -> dict[str, list[list[dict]]]:
    """What each toy teacher pretrains on: its rows as it sees them (its context, if any) with their answers."""
    seen = {
        name: teacher_conversations(conversations, block.context, cfg.teacher_where(name))
        for name, block in cfg.teacher_blocks.items()
        if block.context.enabled
    }
    keys = {name: block.key for name, block in cfg.teacher_blocks.items()}
    return teacher_corpora(conversations, keys, cfg.default_teacher, seen)


def batches_per_pass(prompts: int, logical_batch: int) -> int:
    """The whole batches one pass over `prompts` gives: its last partial batch is dropped (verl's drop_last)."""
    return prompts // logical_batch


def prompt_order(prompts: PromptSet, cfg: MiniverlConfig, needed: int) -> list[int]:
    """Parquet rows in consumption order, as verl's train dataloader yields them: passes over the kept
    prompts, each cut to whole batches of recipe.logical_batch (verl's drop_last), with data.shuffle each
    pass a torch.randperm of one generator seeded with data.seed (verl's RandomSampler); checked against
    verl's own sampler in tests/trainer/test_plan.py."""
    rows = list(prompts.rows)
    whole = batches_per_pass(len(rows), cfg.recipe.logical_batch) * cfg.recipe.logical_batch
    generator = torch.Generator()
    if cfg.data.seed is not None:  # null: torch's default seed, as verl leaves its generator
        generator.manual_seed(cfg.data.seed)
    order: list[int] = []
    while len(order) < needed:
        permutation = torch.randperm(len(rows), generator=generator).tolist() if cfg.data.shuffle else range(len(rows))
        order.extend(rows[i] for i in permutation[:whole])  # the pass's last partial batch is dropped
    return order[:needed]


def compile_plan(cfg: MiniverlConfig, prompts: PromptSet) -> Plan:
    recipe, hardware = cfg.recipe, cfg.hardware
    if recipe.logical_batch > len(prompts):
        raise MiniverlError(
            f"recipe.logical_batch={recipe.logical_batch} is larger than the "
            f"{len(prompts)} usable prompts in data.train_files"
        )
    needed = recipe.logical_batch * recipe.optimizer_updates
    if needed > len(prompts) and not cfg.data.repeat_prompts:
        raise MiniverlError(
            f"data.train_files: the plan needs {needed} prompts (recipe.optimizer_updates={recipe.optimizer_updates} "
            f"x recipe.logical_batch={recipe.logical_batch}) but {len(prompts)} are usable; add prompts, lower "
            "those numbers, or set data.repeat_prompts=true to go through them more than once"
        )
    order = prompt_order(prompts, cfg, needed)
    routes = teacher_routes(cfg, prompts.routes)  # every row is checked, not only the planned ones
    updates = []
    for u in range(1, recipe.optimizer_updates + 1):
        rows = order[(u - 1) * recipe.logical_batch : u * recipe.logical_batch]
        samples = [row for row in rows for _ in range(cfg.rollout.n)]  # verl's interleaved repeat
        updates.append(
            UpdatePlan(
                update=u,
                prompt_rows=tuple(rows),
                sample_rows=tuple(samples),
                sample_seeds=tuple(derive_seed(cfg.trainer.seed, "sample", u, slot) for slot in range(len(samples))),
                rollout_physical_batches=tuple(split(len(samples), hardware.rollout_physical_batch)),
                update_chunks=tuple(split(len(samples), hardware.update_chunk)),
                sample_teachers=tuple(routes[row] for row in samples) if routes else (),
            )
        )
    return Plan(
        version=PLAN_VERSION,
        settings={"miniverl_version": __version__, **experiment_settings(cfg)},
        input_parquet_sha256=prompts.parquet_sha256,
        prompts_available=len(prompts),
        interrupt_after_updates=recipe.resume_check_after,
        updates=tuple(updates),
    )
