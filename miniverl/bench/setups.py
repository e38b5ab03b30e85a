"""What the bench measures on: the scales, the prompts, the ratio keys and their targets, and the
two paths' models (`Setup`, built by `build_float32_setup` and `build_recipe_setup`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

SCHEMA = "miniverl-bench/2"
PATHS = ("recipe", "float32")  # the random-weight paths; `real` runs instead with --student/--teacher
PREFIX = {"recipe": "recipe_", "float32": "", "real": "real_"}
# Each miniverl ÷ other. The float32 path keeps the keys it had (the no-KV-cache baseline and its
# `rollout_vs_no_cache` are gone: one row at a time replaces it); the recipe path's carry `recipe_`.
PATH_RATIO_KEYS = {
    "recipe": (
        "recipe_rollout_vs_hf_generate",
        "recipe_rollout_vs_per_call_dequantize",
        "recipe_rollout_vs_one_row_generate",
        "recipe_scoring_time_vs_naive",
        "recipe_scoring_peak_memory_vs_naive",
        "recipe_opd_step_vs_trl",
        "recipe_opd_step_vs_trl_k1",
        "recipe_update_vs_bare_fwd_bwd",
    ),
    "float32": (
        "rollout_vs_hf_generate",
        "rollout_vs_one_row_generate",
        "scoring_time_vs_naive",
        "scoring_peak_memory_vs_naive",
        "opd_step_vs_trl",
        "update_vs_bare_fwd_bwd",
    ),
}
# The user's own models (--student/--teacher), loaded as the recipe loads them; the peers
# (`generate`, the plain forward) run on copies with bitsandbytes as shipped.
PATH_RATIO_KEYS["real"] = (
    "real_rollout_vs_hf_generate",
    "real_rollout_vs_per_call_dequantize",
    "real_rollout_vs_one_row_generate",
    "real_scoring_vs_hf_forward",
    "real_scoring_time_vs_naive",
    "real_scoring_peak_memory_vs_naive",
    "real_opd_step_vs_trl",
    "real_opd_step_vs_trl_k1",
    "real_update_vs_bare_fwd_bwd",
)
RATIO_KEYS = (*PATH_RATIO_KEYS["recipe"], *PATH_RATIO_KEYS["float32"], *PATH_RATIO_KEYS["real"])
# Targets from the issues, for --scale bench on a 2-core CPU: (comparison, bound).
TARGETS = {
    "recipe_rollout_vs_hf_generate": (">=", 2.0),
    "recipe_opd_step_vs_trl": ("<=", 0.5),
    "rollout_vs_hf_generate": (">=", 1.5),
    "rollout_vs_one_row_generate": (">=", 3.0),
    "scoring_time_vs_naive": ("<=", 1.1),
    "scoring_peak_memory_vs_naive": ("<=", 0.25),
    "opd_step_vs_trl": ("<=", 0.5),
    "update_vs_bare_fwd_bwd": (">=", 0.8),
    "real_rollout_vs_hf_generate": (">=", 1.5),
    "real_scoring_vs_hf_forward": (">=", 1.0),
    "real_update_vs_bare_fwd_bwd": (">=", 0.8),
}

# Architecture presets (Qwen3). The vocabulary of `toy` is the toy tokenizer's (259). `repeats`:
# timed rounds on the float32 path, `recipe_repeats` on the recipe path (NF4 on the CPU is slow).
SCALES = {
    "toy": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "head_dim": 16,
        "vocab_size": None,
        "tie_word_embeddings": False,
        "max_position_embeddings": 1024,
        "repeats": 3,
        "recipe_repeats": 2,
    },
    "bench": {
        "hidden_size": 256,
        "intermediate_size": 768,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "vocab_size": 32768,
        "tie_word_embeddings": False,
        "max_position_embeddings": 1024,
        "repeats": 2,
        "recipe_repeats": 2,
    },
    "mid": {
        "hidden_size": 512,
        "intermediate_size": 1536,
        "num_hidden_layers": 8,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 64,
        "vocab_size": 32768,
        "tie_word_embeddings": False,
        "max_position_embeddings": 1024,
        "repeats": 3,
        "recipe_repeats": 2,
    },
    "qwen3-0.6b-shape": {
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
        "max_position_embeddings": 40960,
        "rope_theta": 1_000_000.0,
        "repeats": 3,
        "recipe_repeats": 2,
    },
}
RUN_KEYS = ("repeats", "recipe_repeats")
PROMPTS = (
    "What is 12 + 30?",
    "Name the three primary colours of light and say in one sentence why they are called primary.",
    "Write one sentence about the sea.",
    "Explain in two sentences what a key-value cache does in a transformer decoder, and why it saves time.",
)
BATCH, NEW_TOKENS = 4, 64
LORA = {"r": 16, "alpha": 32, "target_modules": ("q_proj", "v_proj")}
# DistillationTrainer(beta=1); IWOPDTrainer(iw_opd, gamma=0), the k1 row, on the recipe path only.
TRL_KINDS = {"recipe": ("full_vocab", "k1"), "float32": ("full_vocab",), "real": ("full_vocab", "k1")}


# ---------------------------------------------------------------------------------------------- setup
@dataclass
class Setup:
    path: str  # "recipe" or "float32"
    scale: str
    device: torch.device
    dtype: torch.dtype  # the weights' dtype as written (recipe: bfloat16, NF4 layers compute in it)
    tokenizer: object
    prompt_ids: list[list[int]]
    student: object  # PeftModel (LoRA r16, on `lora_targets`), gradient checkpointing on
    teacher: object  # frozen, another seed
    eos_id: int
    pad_id: int
    description: dict
    # The peers' copies (`generate`, the plain forward) with bitsandbytes as shipped; None: the same models.
    peer_student: object = None
    peer_teacher: object = None
    # The layers the student's LoRA adapts (peft's target_modules: a list, or all-linear).
    lora_targets: object = field(default_factory=lambda: list(LORA["target_modules"]))

    def peer_base(self):
        return (self.peer_student or self.student).get_base_model()


def qwen3_config(scale: str, vocab: int, eos_id: int, pad_id: int, dtype: torch.dtype):
    from transformers import Qwen3Config

    shape = {k: v for k, v in SCALES[scale].items() if k not in RUN_KEYS}
    shape["vocab_size"] = shape["vocab_size"] or vocab
    config = Qwen3Config(
        **shape,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        bos_token_id=None,
        dtype={torch.float32: "float32", torch.bfloat16: "bfloat16"}[dtype],
    )
    config._attn_implementation = "sdpa"
    return config


def bench_tokenizer():
    from miniverl.models import toy

    tokenizer = toy.build_toy_tokenizer()
    return tokenizer, bench_prompts(tokenizer)


def bench_prompts(tokenizer) -> list[list[int]]:
    """The PROMPTS in the tokenizer's own chat template, ids of each (left padding from here on)."""
    tokenizer.padding_side = "left"
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"]
        for p in PROMPTS
    ]


def random_qwen3(config, seed: int, device: torch.device, dtype: torch.dtype, eos_id: int, pad_id: int):
    from transformers import Qwen3ForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        with torch.device(device):
            model = Qwen3ForCausalLM(config).to(dtype)
    model.generation_config.eos_token_id = eos_id
    model.generation_config.pad_token_id = pad_id
    return model.eval()


def nonzero_lora_b(student) -> None:
    """A non-zero LoRA B, so that the adapter carries signal (the same draw on both paths)."""
    with torch.no_grad():
        for name, param in student.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.01, generator=torch.Generator(device=param.device).manual_seed(3))


def build_float32_setup(scale: str, device: torch.device, workdir: Path) -> Setup:
    """Unquantized models built in memory: float32 on the CPU, bfloat16 on CUDA."""
    from peft import LoraConfig, get_peft_model

    from miniverl.models.loading import quiet_loading

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tokenizer, prompt_ids = bench_tokenizer()
    eos_id, pad_id = tokenizer.eos_token_id, tokenizer.pad_token_id
    config = qwen3_config(scale, len(tokenizer), eos_id, pad_id, dtype)
    with quiet_loading():
        student, teacher = (random_qwen3(config, seed, device, dtype, eos_id, pad_id) for seed in (0, 1))
        student.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        student.enable_input_require_grads()
        lora = LoraConfig(
            r=LORA["r"],
            lora_alpha=LORA["alpha"],
            lora_dropout=0.0,
            target_modules=list(LORA["target_modules"]),
            task_type="CAUSAL_LM",
        )
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(2)
            student = get_peft_model(student, lora).eval()
        nonzero_lora_b(student)
    teacher.requires_grad_(False)
    # TRL's IWOPDTrainer loads the teacher's tokenizer from the teacher's folder.
    tokenizer.save_pretrained(workdir / "tokenizer")
    teacher.config._name_or_path = str(workdir / "tokenizer")
    described = {
        "student": f"{str(dtype).replace('torch.', '')}, LoRA r{LORA['r']} on q/v, gradient checkpointing",
        "teacher": f"{str(dtype).replace('torch.', '')}, frozen, another seed",
        "quantization": None,
    }
    return Setup("float32", scale, device, dtype, tokenizer, prompt_ids, student, teacher, eos_id, pad_id, described)


def as_shipped(model, device: torch.device):
    """A copy of a loaded model with bitsandbytes' own CPU choice back (miniverl's loader switches
    off its AVX512-BF16 repack, models/loading.py): what a user's plain transformers code runs.
    None where that choice is miniverl's too (CUDA, a CPU without AVX512-BF16): no copy needed.
    With oneDNN capped below bf16 (ONEDNN_MAX_CPU_ISA, utils/device.py) the peers run as on a CPU
    without it too: how an AMX machine measures the AVX2 kind."""
    import copy

    from miniverl.utils.device import cpu_bf16_instructions

    try:
        from bitsandbytes.functional import has_avx512bf16
    except ImportError:
        return None
    if device.type != "cpu" or not has_avx512bf16() or cpu_bf16_instructions() is None:
        return None
    twin = copy.deepcopy(model)
    for module in twin.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            # bitsandbytes 0.50's repack fails on widths that are not a multiple of its block, on outputs that are
            # not a multiple of 32 rows and on odd inputs (Jamba's x_proj: 24 rows; a user's own code stops there
            # with an AssertionError): those layers keep the dequantize path.
            rows, width = module.out_features, module.in_features
            fits = width % module.weight.quant_state.blocksize == 0 and rows % 32 == 0 and width % 2 == 0
            module.support_avx512bf16_for_cpu = fits
    return twin


def build_real_setup(student_path: str, teacher_path: str, device: torch.device) -> Setup:
    """The user's own models (any Hugging Face causal LM folders), loaded as `+recipe=opd_k1` loads
    them: NF4 with compute in the checkpoint's dtype, prepare_model_for_kbit_training, LoRA r16 on
    q/v (all-linear for a family without q_proj and v_proj), gradient checkpointing, SDPA attention
    (eager for a family without it); the prompts in the student's own chat template."""
    from miniverl.config.model import ALL_LINEAR, LoraSettings, StudentConfig
    from miniverl.config.teacher import TeacherConfig
    from miniverl.models import adapters, tokenizers
    from miniverl.models import loading as models
    from miniverl.utils.errors import MiniverlError

    for flag, path in (("--student", student_path), ("--teacher", teacher_path)):
        if not (Path(path) / "config.json").is_file():
            raise MiniverlError(
                f"{flag} {path}: not a Hugging Face model folder (no config.json); give the folder that holds "
                "config.json, the weights and the tokenizer (python -m miniverl.real_models builds two)"
            )
    lora = LoraSettings(r=LORA["r"], alpha=LORA["alpha"], dropout=0.0, target_modules=list(LORA["target_modules"]))
    student_block = StudentConfig(model_id=student_path, dtype="auto", quantization="nf4", lora=lora)
    teacher_block = TeacherConfig(model_id=teacher_path, dtype="auto", quantization="nf4")
    sources = [models.source_of(block, None) for block in (student_block, teacher_block)]
    for block, source in zip((student_block, teacher_block), sources):  # SDPA where the family has it
        family = models.model_class(block, source)
        block.attn_implementation = "eager" if family is not None and not family._supports_sdpa else "sdpa"
    tokenizer = models.load_tokenizer("--student", student_block, sources[0])
    base = models.load_causal_lm("--student", student_block, sources[0], device)
    if adapters.absent_targets(base, lora.target_modules):  # a family with other names (Phi-3: qkv_proj)
        lora.target_modules = ALL_LINEAR
    student = models.wrap_student(base, student_block, device, lora_seed=2)
    teacher = models.load_teacher(teacher_block, sources[1], device, "--teacher")
    tokenizers.check_tokenizers_compatible(
        tokenizer,
        models.load_tokenizer("--teacher", teacher_block, sources[1]),
        student.get_base_model(),
        teacher,
        "--teacher",
    )
    nonzero_lora_b(student)
    prompt_ids = bench_prompts(tokenizer)
    eos_id = tokenizer.eos_token_id  # the end of a turn (<|im_end|> for ChatML models)
    for model in (student.get_base_model(), teacher):  # one EOS for every side
        model.generation_config.eos_token_id = eos_id
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    dtype = models.compute_dtype(student_block, sources[0])
    described = {
        "student": f"{student_path}: NF4 ({str(dtype).replace('torch.', '')} compute) + "
        f"prepare_model_for_kbit_training, LoRA r{LORA['r']} on {lora.describe_targets()}, gradient checkpointing, "
        f"{student_block.attn_implementation} attention (models.load_student)",
        "teacher": f"{teacher_path}: NF4, frozen, {teacher_block.attn_implementation} attention (models.load_teacher)",
        "quantization": "nf4",
        "peers": "generate, the plain forward and TRL run with bitsandbytes' CPU kernel choice as shipped "
        "(on copies where it differs from miniverl's: a CPU with AVX512-BF16)",
    }
    return Setup(
        "real", "real", device, dtype, tokenizer, prompt_ids, student, teacher, eos_id, tokenizer.pad_token_id,
        described, peer_student=as_shipped(student, device), peer_teacher=as_shipped(teacher, device),
        lora_targets=lora.peft_targets(),
    )  # fmt: skip


def build_recipe_setup(scale: str, device: torch.device, workdir: Path) -> Setup:
    """What `+recipe=opd_k1` runs: bfloat16 checkpoints loaded by miniverl's own loaders (NF4 via
    bitsandbytes with bf16 compute, prepare_model_for_kbit_training, LoRA r16 alpha 32 on q/v,
    gradient checkpointing; the teacher NF4, frozen)."""
    from miniverl.config.model import LoraSettings, StudentConfig
    from miniverl.config.teacher import TeacherConfig
    from miniverl.models import loading as models

    tokenizer, prompt_ids = bench_tokenizer()
    eos_id, pad_id = tokenizer.eos_token_id, tokenizer.pad_token_id
    config = qwen3_config(scale, len(tokenizer), eos_id, pad_id, torch.bfloat16)
    folders = {}
    with models.quiet_loading():
        for name, seed in (("student", 0), ("teacher", 1)):
            model = random_qwen3(config, seed, torch.device("cpu"), torch.bfloat16, eos_id, pad_id)
            folders[name] = workdir / name
            model.save_pretrained(folders[name])
            tokenizer.save_pretrained(folders[name])
            del model
    lora = LoraSettings(r=LORA["r"], alpha=LORA["alpha"], dropout=0.0, target_modules=list(LORA["target_modules"]))
    student_block = StudentConfig(model_id=str(folders["student"]), dtype="auto", quantization="nf4", lora=lora)
    teacher_block = TeacherConfig(model_id=str(folders["teacher"]), dtype="auto", quantization="nf4")
    student = models.load_student(student_block, models.source_of(student_block, None), device, lora_seed=2)
    teacher = models.load_teacher(teacher_block, models.source_of(teacher_block, None), device)
    nonzero_lora_b(student)
    for model in (student.get_base_model(), teacher):
        model.generation_config.eos_token_id = eos_id
        model.generation_config.pad_token_id = pad_id
    described = {
        "student": "NF4 (bitsandbytes, bf16 compute) + prepare_model_for_kbit_training, "
        f"LoRA r{LORA['r']} on q/v, gradient checkpointing (models.load_student)",
        "teacher": "NF4 (bf16 compute), frozen, another seed (models.load_teacher)",
        "quantization": "nf4",
        "checkpoint_dtype": "bfloat16",
    }
    return Setup(
        "recipe", scale, device, torch.bfloat16, tokenizer, prompt_ids, student, teacher, eos_id, pad_id, described
    )
