"""Shared test setup: no network, the CPU only, configs composed with Hydra's compose API."""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ["CUDA_VISIBLE_DEVICES"] = ""  # tests run on the CPU even where a GPU exists

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402

import miniverl.schema  # noqa: E402,F401  (registers the schemas)

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
DATA = Path(__file__).resolve().parent / "data"
# Short toy runs: same recipe, fewer and shorter updates.
SHORT = ["model=toy", "teacher=toy", "hardware=cpu", "recipe.optimizer_updates=3", "recipe.interrupt_after_updates=null",
         "recipe.response_limit=16", "trainer.progress_bar=false"]


def compose_config(overrides: list[str] = ()):  # -> DictConfig
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


@pytest.fixture(autouse=True)
def run_from_repo_root(monkeypatch):
    """Relative data paths in conf/ are taken from the repository root, where users run commands."""
    monkeypatch.chdir(ROOT)


@pytest.fixture
def toy_config():
    return lambda *extra: compose_config(["+recipe=opd_k1", *SHORT, *extra])
