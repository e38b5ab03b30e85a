"""Loading the student and the teacher through `transformers` (Auto classes), `bitsandbytes`
(NF4) and `peft` (LoRA).

Which numerical path each role takes (measured on bitsandbytes 0.50, see tests/models/test_loading.py):
on a CPU with AVX512-BF16, bitsandbytes repacks an NF4 weight in place for a bf16 kernel the
first time its layer runs in eval mode without grad; from then on that layer differs from the
dequantized base by ~0.5%, permanently. Rollout and teacher scoring run in eval mode without
grad, the update in train mode with grad, so the repack would make the rollout's log-probs and
the update's gradients disagree with each other. miniverl therefore switches the repack off for
every NF4 layer it loads: every role computes against the same dequantized weights, and the
LoRA gradients equal those through the dequantized base.
"""

from __future__ import annotations

import ast
import logging
import re
import warnings
from collections.abc import Sequence
from contextlib import contextmanager
from pathlib import Path

import bitsandbytes as bnb
import torch
import transformers
from peft import LoraConfig, PeftModel, get_peft_model, prepare_model_for_kbit_training
from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig, PreTrainedModel

from miniverl.config.model import ALL_LINEAR, StudentConfig, hub_revision
from miniverl.config.teacher import TeacherConfig
from miniverl.models import adapters, nf4_cache, toy
from miniverl.models.sources import Source, offline_error, setting_of, source_of
from miniverl.utils.device import package_version
from miniverl.utils.errors import MiniverlError
from miniverl.utils.hydra_entry import log_line
from miniverl.utils.measure import trim_heap
from miniverl.utils.overrides import hydra_value

log = logging.getLogger(__name__)

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@contextmanager
def quiet_loading():
    """Loading/saving bars and deprecation notices of the libraries are noise in a training log."""
    transformers.utils.logging.disable_progress_bar()
    previous = transformers.utils.logging.get_verbosity()
    transformers.utils.logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # peft calls transformers' renamed GC API
            warnings.filterwarnings("ignore", module="peft")
            yield
    finally:
        transformers.utils.logging.set_verbosity(previous)


def materialize_toys(
    student: StudentConfig,
    teachers: dict[str, TeacherConfig],
    folder: Path,
    *,
    student_seed: int,
    corpus_texts: dict[str, Sequence[list[dict]]] | None = None,
) -> dict[str, Path]:
    """Write the toy student to `folder/student` and each toy teacher (the separate teacher models
    by name; "teacher" for the single one) to `folder/teacher` or `folder/teachers/<name>`; return
    their paths by name. A toy teacher pretrains on `corpus_texts[name]`, the rows it scores."""
    with quiet_loading():
        paths = {}
        if student.model_id == "toy":
            tokenizer = toy.build_toy_tokenizer(student.toy.tokenizer)
            model = toy.build_toy_model(student.toy, tokenizer, seed=student_seed)
            paths["student"] = toy.save_toy(model, tokenizer, folder / "student", student.toy.dtype)
        for name, teacher in teachers.items():
            if teacher.model_id == "toy":
                where = folder / "teacher" if name == "teacher" else folder / "teachers" / name
                corpus = (corpus_texts or {}).get(name, ())
                paths[name] = _materialize_toy_teacher(teacher, where, student_seed, corpus)
        return paths


def _materialize_toy_teacher(teacher: TeacherConfig, where: Path, student_seed: int, corpus_texts) -> Path:
    tokenizer = toy.build_toy_tokenizer(teacher.toy.tokenizer)
    seed = student_seed if teacher.toy_teacher_seed is None else teacher.toy_teacher_seed
    model = toy.build_toy_model(teacher.toy, tokenizer, seed=seed)
    corpus = [tokenizer.apply_chat_template(conv, tokenize=False) for conv in corpus_texts]
    corpus_ids = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in corpus]
    steps, lr = teacher.toy_pretrain_steps, teacher.toy_pretrain_lr
    toy.pretrain_on_corpus(model, corpus_ids, steps=steps, lr=lr, seed=seed, pad_id=tokenizer.pad_token_id)
    return toy.save_toy(model, tokenizer, where, teacher.toy.dtype)


# A folder with none of these holds no tokenizer at all (a model saved without it); one with any of
# them may still fail to load for another reason (a missing sentencepiece, its own code), said as it is.
TOKENIZER_FILES = ("tokenizer*", "*.model", "*.tiktoken", "tekken.json", "vocab.*", "merges.txt")


def load_tokenizer(where: str, block: StudentConfig | TeacherConfig, source: Source | None):
    """The toy tokenizer (built in memory), or the model's tokenizer through AutoTokenizer."""
    if block.model_id == "toy" and block.tokenizer_id is None:
        return toy.build_toy_tokenizer(block.toy.tokenizer)
    trust_remote_code = block.trust_remote_code
    try:
        with quiet_loading():
            tokenizer = AutoTokenizer.from_pretrained(
                source.tokenizer_path, revision=source.tokenizer_revision, trust_remote_code=trust_remote_code
            )
    except (OSError, ValueError) as error:
        key = "tokenizer_id" if block.tokenizer_id else "model_id"
        folder = Path(source.tokenizer_path).expanduser()
        no_tokenizer = folder.is_dir() and not any(any(folder.glob(pattern)) for pattern in TOKENIZER_FILES)
        # A model_id folder without config.json is not a model at all: offline_error says what it needs.
        if no_tokenizer and (block.tokenizer_id or (folder / "config.json").is_file()):
            setting = setting_of(where, key)
            fix = "" if where.startswith("--") or block.tokenizer_id else f", or set {where}.tokenizer_id to one"
            raise MiniverlError(
                f"{setting}={source.tokenizer_path} holds no tokenizer (none of {', '.join(TOKENIZER_FILES)}): save "
                f"the model's tokenizer there (tokenizer.save_pretrained(folder)){fix}"
            ) from None
        raise offline_error(
            where, Source(source.tokenizer_path, source.tokenizer_revision, "", None), error, key
        ) from None
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    missing = []
    if tokenizer.eos_token_id is None:
        missing.append("an EOS token")
    if not tokenizer.chat_template:  # a base model's often has none, and the prompts are chat messages
        missing.append("a chat template")
    if missing:
        fix = ""
        if not where.startswith("--") and block.tokenizer_id is None:  # a config path: the user's to set
            fix = f"; set {where}.tokenizer_id to a folder whose tokenizer has {'them' if len(missing) > 1 else 'it'}"
            fix += " (the instruct model's)"
            if missing == ["a chat template"]:
                fix += ", or add chat_template.jinja to the folder"
        raise MiniverlError(f"{where}: the tokenizer of {source.tokenizer_path} lacks {' and '.join(missing)}{fix}")
    return tokenizer


def compute_dtype(block: StudentConfig | TeacherConfig, source: Source) -> torch.dtype:
    if block.dtype != "auto":
        return TORCH_DTYPES[block.dtype]
    config = transformers.AutoConfig.from_pretrained(
        source.path, revision=source.revision, trust_remote_code=block.trust_remote_code
    )
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.float32
    return TORCH_DTYPES[dtype] if isinstance(dtype, str) else dtype


def load_causal_lm(
    where: str, block: StudentConfig | TeacherConfig, source: Source, device: torch.device, use_nf4_cache: bool = True
) -> PreTrainedModel:
    """The model of `block`, NF4 where it says so: quantized once per machine and read back from
    models/nf4_cache after that where `use_nf4_cache` (hardware.nf4_cache) is on."""
    try:
        dtype = compute_dtype(block, source)
        quantization = None
        folder = nf4_cache.source_folder(source.path, source.revision)
        if block.quantization == "nf4" and (folder is None or nf4_cache.saved_quantization(folder) is None):
            # (a checkpoint saved quantized loads as saved: the pre-flight's `quantization` check says how)
            quantization = BitsAndBytesConfig(
                load_in_4bit=True,
                bnb_4bit_quant_type="nf4",
                bnb_4bit_compute_dtype=dtype,
                bnb_4bit_use_double_quant=False,
            )
        cached = quantization is not None and use_nf4_cache and block.model_id != "toy" and not block.trust_remote_code
        entry = nf4_cache_entry(source, quantization, device) if cached else None
        model = _load_nf4_entry(entry, block, dtype, device, source.path) if entry is not None else None
        if model is None:
            with quiet_loading():
                model, loaded = AutoModelForCausalLM.from_pretrained(
                    source.path,
                    revision=source.revision,
                    dtype=dtype,
                    **({"quantization_config": quantization} if quantization else {}),  # None: the checkpoint's
                    attn_implementation=block.attn_implementation,
                    trust_remote_code=block.trust_remote_code,
                    device_map=device_map(device),
                    output_loading_info=True,
                )
            refuse_random_weights(where, source, model, loaded["missing_keys"])
            if cached and (found := nf4_cache_entry(source, quantization, device)) is not None:
                # Keyed again: a hub model's weights were downloaded just now. An entry there did not check or
                # load where the model now did: it is damaged (or of another release's format), replaced.
                nf4_cache.store(model, found, source.path, device, replace=found.folder.exists())
    except (OSError, ValueError) as error:
        if isinstance(error, ValueError) and "attn_implementation" in str(error):
            # transformers' own text goes on to a generic example; its first sentence says what.
            what = str(error).split(". ")[0].strip().rstrip(".")
            fix = f"; set {where}.attn_implementation=eager" if block.attn_implementation != "eager" else ""
            fix = "" if where.startswith("--") else fix  # a command-line flag: not a setting of the user's
            raise MiniverlError(f"{where}.attn_implementation={block.attn_implementation!r}: {what}{fix}") from None
        raise offline_error(where, source, error) from None
    disable_cpu_nf4_repack(model)
    if block.quantization == "nf4":
        warn_unquantized(where, model)
    trim_heap()  # the checkpoint's full-precision weights, freed once quantized
    return model


def warn_unquantized(where: str, model: PreTrainedModel) -> None:
    """Said where NF4 left much of a model in full precision: transformers quantizes nn.Linear and Conv1D
    layers only, not a family's own subclass of them (Falcon's FalconLinear, every layer of the model)."""
    linear = [m for m in model.modules() if isinstance(m, torch.nn.Linear) and m is not model.get_output_embeddings()]
    kept = [m for m in linear if not isinstance(m, bnb.nn.Linear4bit)]
    share = sum(m.weight.numel() for m in kept) / max(1, sum(m.weight.numel() for m in linear))
    if share > 0.1:  # a MoE router's few weights (Llama 4's, Phi-3.5-MoE's) are not worth a line
        kinds = ", ".join(sorted({type(m).__name__ for m in kept}))
        line = (
            f"{where}: {share:.0%} of the linear weights ({len(kept)} layers: {kinds}) stay in {kept[0].weight.dtype}"
        )
        line += " under NF4: transformers quantizes nn.Linear and Conv1D, not a family's own subclass; the memory"
        log_line(log, line + " estimate (pre-flight) counted them as 4-bit", logging.WARNING, console=True)


def refuse_random_weights(where: str, source: Source, model: PreTrainedModel, missing: set[str]) -> None:
    """A checkpoint without some of the model's weights (transformers initialises them at random and says so
    in a warning): a folder saved with AutoModel has no output layer, so the run would distil into noise."""
    parameters = dict(model.named_parameters())
    unloaded = sorted(name for name in missing if name in parameters)
    if not unloaded:
        return
    output = model.get_output_embeddings()
    headless = output is not None and any(parameters[name] is output.weight for name in unloaded)
    more = f" (and {len(unloaded) - 3} more)" if len(unloaded) > 3 else ""
    why = "; saved with AutoModel, it has no output layer: save it with AutoModelForCausalLM" if headless else ""
    setting = setting_of(where)
    raise MiniverlError(
        f"{setting}={source.path}: the checkpoint holds no {', '.join(unloaded[:3])}{more}, which would start at "
        f"random{why}"
    )


def device_map(device: torch.device) -> dict:
    return {"": device.index if device.type == "cuda" else "cpu"}


def nf4_cache_entry(source: Source, quantization: BitsAndBytesConfig, device: torch.device) -> nf4_cache.Entry | None:
    return nf4_cache.entry_for(source.path, source.revision, quantization.to_dict(), device)


def _load_nf4_entry(
    entry: nf4_cache.Entry, block: StudentConfig | TeacherConfig, dtype: torch.dtype, device: torch.device, name: str
) -> PreTrainedModel | None:
    """The model saved in the NF4 cache's `entry`; None where there is none, or where it would not load
    (then the source is loaded as without the cache: a mistake of the block's fails there, in its one line)."""
    if not (entry.folder / "config.json").is_file() or not nf4_cache.whole(entry):
        return None
    try:
        with quiet_loading():
            model = AutoModelForCausalLM.from_pretrained(  # its config holds the quantization settings
                entry.folder, dtype=dtype, attn_implementation=block.attn_implementation, device_map=device_map(device)
            )
    except Exception:
        return None
    nf4_cache.mark_read(entry, name)
    # What an adapter's base_model_name_or_path names (peft reads it here): the user's model, not the cache.
    model.config.name_or_path = model.name_or_path = name
    return model


def model_class(block: StudentConfig | TeacherConfig, source: Source) -> type[PreTrainedModel] | None:
    """The transformers class the block loads as, from its config.json alone (no weights); None
    when the config cannot be read here or names no class transformers ships (loading decides)."""
    try:
        config = transformers.AutoConfig.from_pretrained(
            source.path, revision=source.revision, trust_remote_code=block.trust_remote_code
        )
    except (OSError, ValueError):
        return None
    return AutoModelForCausalLM._model_mapping.get(type(config), None)


def lora_targets_problem(block: StudentConfig) -> str | None:
    """model.lora.target_modules against the student's layer names, from its config.json alone (the
    model built on the meta device: no weights read, no memory); None when they match, and for
    all-linear, an adapter to start from, the toy, a model with its own code (not run for a check)
    or a config not on this machine (no download: loading checks)."""
    targets = block.lora.peft_targets()
    if targets == ALL_LINEAR or block.adapter or block.model_id == "toy" or block.trust_remote_code:
        return None
    source = source_of(block, None)
    try:
        config = transformers.AutoConfig.from_pretrained(source.path, revision=source.revision, local_files_only=True)
        with torch.device("meta"), quiet_loading():
            model = AutoModelForCausalLM.from_config(config)
    except Exception:  # best effort (unreadable here, not a causal LM transformers builds...): loading checks too
        return None
    return adapters.targets_problem(model, targets)


def decoder_of(model: torch.nn.Module) -> torch.nn.Module:
    """The model's decoder stack (hidden states, no output layer): get_decoder(), or the stack inside where a
    transformers class returns the causal LM itself (Llama 4's text model in transformers 5.25)."""
    decoder = model.get_decoder()
    inner = getattr(decoder, "model", None)
    return inner if inner is not None and decoder.get_output_embeddings() is not None else decoder


def disable_cpu_nf4_repack(model: torch.nn.Module) -> int:
    """Keep bitsandbytes' NF4 layers on the dequantize path in every mode (see module docstring)."""
    count = 0
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False
            count += 1
    return count


def load_student(
    block: StudentConfig, source: Source, device: torch.device, *, lora_seed: int, use_nf4_cache: bool = True
) -> PeftModel:
    model = load_causal_lm("model", block, source, device, use_nf4_cache)
    with quiet_loading():
        return wrap_student(model, block, device, lora_seed)


@quiet_loading()  # peft's and transformers' notices while wrapping, as while loading
def wrap_student(model: PreTrainedModel, block: StudentConfig, device: torch.device, lora_seed: int) -> PeftModel:
    if block.quantization == "nf4" and block.prepare_kbit_training:
        # Casts the non-quantized parameters to float32 and enables gradient checkpointing.
        model = prepare_model_for_kbit_training(
            model,
            use_gradient_checkpointing=block.gradient_checkpointing,
            gradient_checkpointing_kwargs={"use_reentrant": False},
        )
    elif block.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    if block.adapter:
        return adapters.student_from_adapter(model, block.adapter).eval()
    targets = block.lora.peft_targets()
    if targets != ALL_LINEAR and (problem := adapters.targets_problem(model, targets)):
        raise MiniverlError(problem)
    if problem := adapters.routers_problem(model, targets):
        raise MiniverlError(problem)
    lora = LoraConfig(
        r=block.lora.r,
        lora_alpha=block.lora.alpha,
        lora_dropout=block.lora.dropout,
        target_modules=targets,
        bias=block.lora.bias,
        task_type="CAUSAL_LM",
        revision=hub_revision(block.model_id, block.revision),  # adapter_config.json's: the base's pinned commit
    )
    # The names a refusal's fix keeps from: read before peft, which wraps layers before it may refuse one.
    listed = adapters.linear_layer_names(model) if targets == ALL_LINEAR else targets
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(lora_seed)  # LoRA A's initialisation draws from the global generator
        try:
            peft_model = get_peft_model(model, lora)
        except ValueError as error:
            fix = targets_fix(model.config.model_type, listed, error)
            raise MiniverlError(f"model.lora.target_modules={hydra_value(targets)}: {fix}") from None
    if missed := adapters.unadapted_layers(peft_model.get_base_model(), targets):  # peft's MoE remap, silent
        shown = ", ".join(missed[:4]) + (f" and {len(missed) - 4} more" if len(missed) > 4 else "")
        leaves = ", ".join(dict.fromkeys(name.rsplit(".", 1)[-1] for name in missed))
        log_line(
            log,
            f"model.lora.target_modules={hydra_value(targets)}: peft {package_version('peft')} leaves {len(missed)} "
            f"linear layers untrained ({shown}): it takes {leaves} of a {model.config.model_type} model for its "
            "experts' parameters (the adapter's target_parameters) and drops the layers of those names",
            logging.WARNING,
            console=True,
        )
    # Gradient checkpointing is only active in train mode: rollout and log-prob passes run in eval.
    return peft_model.eval()


def targets_fix(model_type: str, targets: list[str], error: ValueError) -> str:
    """peft's refusal of LoRA target names, with the list to set where peft names the layers it refuses
    (a Mamba-family model: its state-space layers' out_proj and conv1d, which all-linear takes too):
    `targets` (the names listed, or every linear layer's for all-linear) without those."""
    refused = re.search(r"Incompatible modules: (\{[^}]*\})", str(error))
    if refused is None:
        return str(error)
    names = ast.literal_eval(refused.group(1))
    kept = ",".join(name for name in targets if name not in names)
    return (
        f"peft adapts no {', '.join(sorted(names))} of a {model_type} model (state-space layers); "
        f"set model.lora.target_modules=[{kept}]"
    )


def load_teacher(
    block: TeacherConfig, source: Source, device: torch.device, where: str = "teacher", use_nf4_cache: bool = True
) -> PreTrainedModel:
    """mode=standard: a separate frozen model, with its adapter applied when set (`where`: the
    teacher's config path, `teacher` or `teachers.<name>`)."""
    model = load_causal_lm(where, block, source, device, use_nf4_cache)
    model.requires_grad_(False)
    if block.adapter:
        with quiet_loading():
            model = adapters.teacher_with_adapter(model, block.adapter, f"{where}.adapter")
    return model.eval()
