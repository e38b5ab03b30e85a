"""Model loading: LoRA gradients through the NF4 base equal those through the dequantized base,
NF4 layers stay on one numerical path in every mode, and missing weights give one clear line."""

from __future__ import annotations

import json

import bitsandbytes as bnb
import pytest
import torch
from transformers import AutoModelForCausalLM

from miniverl.config.model import StudentConfig
from miniverl.config.teacher import TeacherConfig
from miniverl.models import adapters, tokenizers
from miniverl.models import loading as models
from miniverl.utils.device import package_version
from miniverl.utils.errors import MiniverlError


@pytest.fixture(scope="module")
def toy_dirs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("toys")
    return models.materialize_toys(StudentConfig(), {"teacher": TeacherConfig()}, folder, student_seed=7)


def dequantized_copy(nf4_model, toy_dir):
    """A float32 model whose linear layers hold exactly the NF4 model's dequantized weights."""
    dense = AutoModelForCausalLM.from_pretrained(toy_dir, dtype=torch.float32)
    # LoRA wraps q/v: their NF4 layer is `<name>.base_layer` in the PEFT model.
    quantized = {n.replace(".base_layer", ""): m for n, m in nf4_model.named_modules()}
    copied = 0
    with torch.no_grad():
        for name, module in dense.named_modules():
            source = quantized.get(name)
            if isinstance(source, bnb.nn.Linear4bit):
                module.weight.copy_(bnb.functional.dequantize_4bit(source.weight.data, source.weight.quant_state))
                copied += 1
    assert copied == 2 * 7  # every linear layer of the 2 decoder layers
    return dense


def lora_grads(peft_model, ids):
    peft_model.train()
    peft_model.zero_grad()
    logits = peft_model(input_ids=ids).logits.float()
    loss = torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:])
    loss.backward()
    return {n: p.grad.clone() for n, p in peft_model.named_parameters() if p.requires_grad}


def test_lora_gradients_through_nf4_equal_those_through_the_dequantized_base(toy_dirs):
    src = models.source_of(StudentConfig(), toy_dirs["student"])
    cpu = torch.device("cpu")
    nf4 = models.load_student(StudentConfig(), src, cpu, lora_seed=3)
    q = nf4.get_base_model().config.quantization_config  # docs/models.md: NF4, no double quantization
    assert (q.bnb_4bit_quant_type, q.bnb_4bit_use_double_quant, q.load_in_4bit) == ("nf4", False, True)
    dense_block = StudentConfig(quantization="none")
    dense_base = dequantized_copy(nf4.get_base_model(), toy_dirs["student"])
    dense = models.wrap_student(dense_base, dense_block, cpu, lora_seed=3)
    # A non-zero B so that the LoRA path carries signal into later layers.
    with torch.no_grad():
        for (n1, p1), (_, p2) in zip(nf4.named_parameters(), dense.named_parameters()):
            if "lora_B" in n1:
                p1.fill_(0.01)
                p2.fill_(0.01)
    ids = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(0))
    g_nf4, g_dense = lora_grads(nf4, ids), lora_grads(dense, ids)
    assert g_nf4.keys() == g_dense.keys() and len(g_nf4) == 8  # 2 layers x {q, v} x {A, B}
    for name in g_nf4:
        torch.testing.assert_close(g_nf4[name], g_dense[name], rtol=1e-5, atol=1e-7)


def test_nf4_layers_keep_one_numerical_path_in_eval_mode_without_grad(toy_dirs):
    src = models.source_of(TeacherConfig(), toy_dirs["teacher"])
    teacher = models.load_teacher(TeacherConfig(), src, torch.device("cpu"))
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        eval_logits = teacher(input_ids=ids).logits
    layers = [m for m in teacher.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert layers and not any(getattr(m.weight.quant_state, "packing_format_for_cpu", False) for m in layers)
    teacher.train()
    with torch.enable_grad():
        train_logits = teacher(input_ids=ids).logits
    torch.testing.assert_close(eval_logits, train_logits, rtol=1e-5, atol=1e-5)


def test_weights_that_cannot_be_had_offline_give_one_clear_line():
    block = StudentConfig(model_id="Qwen/Qwen3-0.6B", revision="c1899de289a04d12100db370d81485cdf75e47ca")
    src = models.source_of(block, None)
    with pytest.raises(MiniverlError) as info:
        models.load_student(block, src, torch.device("cpu"), lora_seed=0)
    message = str(info.value)
    assert "Qwen/Qwen3-0.6B" in message and "c1899de289a04d12100db370d81485cdf75e47ca" in message
    assert "model=toy teacher=toy" in message and "\n" not in message
    assert message.endswith("; model.revision pins a commit of one repository: set model.revision=null for another")


def test_a_model_folder_that_is_missing_or_not_a_model_is_named_as_such(tmp_path):
    missing = StudentConfig(model_id=str(tmp_path / "nope"), revision="c1899de289a04d12100db370d81485cdf75e47ca")
    with pytest.raises(MiniverlError) as info:
        models.load_tokenizer("model", missing, models.source_of(missing, None))
    assert str(info.value).startswith(f"model.model_id={tmp_path / 'nope'}: no such folder (relative to ")
    assert "hf download" not in str(info.value) and "\n" not in str(info.value)

    (tmp_path / "empty").mkdir()
    empty = TeacherConfig(model_id=str(tmp_path / "empty"))
    with pytest.raises(MiniverlError) as info:
        models.load_teacher(empty, models.source_of(empty, None), torch.device("cpu"))
    line = str(info.value)
    assert line.startswith(f"teacher.model_id={tmp_path / 'empty'} is a folder but not a model (")
    assert line.endswith("config.json, the weights (*.safetensors) and the tokenizer's files")


def tokenizer_refusal(folder, files: dict[str, str]) -> str:
    """The one line a student `folder` holding `files` (name -> text) gets when its tokenizer is loaded."""
    folder.mkdir()
    for name, text in files.items():
        (folder / name).write_text(text)
    block = StudentConfig(model_id=str(folder))
    with pytest.raises(MiniverlError) as info:
        models.load_tokenizer("model", block, models.source_of(block, None))
    return str(info.value)


def test_a_peft_adapter_given_as_the_model_names_both_settings_to_use(tmp_path):
    """A model-families audit: a LoRA fine-tune's output folder given as model_id was "a folder but not a
    model" (or the tokenizer's error); it is an adapter, which miniverl takes beside its base. With the
    fine-tune's tokenizer saved there too (SFT trainers write it), the model's load says the same."""
    from miniverl.models import toy

    folder = tmp_path / "sft-lora"
    adapter = {"adapter_config.json": '{"peft_type": "LORA", "base_model_name_or_path": "Qwen/Qwen3-0.6B"}'}
    assert tokenizer_refusal(folder, {**adapter, "adapter_model.safetensors": ""}) == (
        f"model.model_id={folder} is a PEFT adapter, not a model; set model.adapter={folder} "
        "model.model_id=Qwen/Qwen3-0.6B"
    )
    toy.build_toy_tokenizer().save_pretrained(folder)
    teacher = TeacherConfig(model_id=str(folder), quantization="none")
    with pytest.raises(MiniverlError) as info:
        models.load_teacher(teacher, models.source_of(teacher, None), torch.device("cpu"))
    assert str(info.value).startswith(f"teacher.model_id={folder} is a PEFT adapter, not a model; set teacher.adapter=")


@pytest.mark.parametrize("quantization", ["nf4", "none"])
def test_a_folder_saved_with_automodel_has_no_output_layer_and_is_refused_not_trained_at_random(tmp_path, quantization):
    """A model-families audit: a model saved with AutoModel (the body, no lm_head) ran to the end on an output
    layer transformers initialised at random, without a word (a warning in a log it quiets)."""
    from transformers import AutoModel

    from conftest import family_folder

    folder = family_folder("phi3", tmp_path, 0)  # its own output layer: not tied to the embeddings
    AutoModel.from_pretrained(folder).save_pretrained(folder)  # the body alone, over the whole model's weights
    block = StudentConfig(model_id=str(folder), quantization=quantization)
    with pytest.raises(MiniverlError) as info:
        models.load_student(block, models.source_of(block, None), torch.device("cpu"), lora_seed=0)
    assert str(info.value) == (
        f"model.model_id={folder}: the checkpoint holds no lm_head.weight, which would start at random; saved with "
        "AutoModel, it has no output layer: save it with AutoModelForCausalLM"
    )


def student_with_targets(folder, targets):
    """A bf16 student of `folder` with LoRA on `targets`, or the one line that refuses them (a str)."""
    block = StudentConfig(model_id=str(folder), quantization="none")
    block.lora.target_modules = targets
    try:
        return models.load_student(block, models.source_of(block, None), torch.device("cpu"), lora_seed=0)
    except MiniverlError as refused:
        return str(refused)


def fixed_list(line: str) -> list[str]:
    """The target list a refusal's line says to set."""
    return line.split("set model.lora.target_modules=[")[1].rstrip("]").split(",")


def test_all_linear_on_a_mamba_family_model_names_the_target_list_peft_takes(tmp_path):
    """A model-families audit: peft refuses LoRA on a Mamba-family model's state-space out_proj (all-linear
    takes it), and the line passed peft's refusal on with nothing to set; the list it names then runs."""
    from conftest import family_folder

    folder = family_folder("falcon_h1", tmp_path, 0)
    line = student_with_targets(folder, "all-linear")
    assert line.startswith("model.lora.target_modules=all-linear: peft adapts no conv1d, out_proj of a falcon_h1 ")
    listed = fixed_list(line)
    assert "out_proj" not in listed and {"q_proj", "o_proj", "in_proj", "down_proj"} <= set(listed)
    student = student_with_targets(folder, listed)
    assert any("lora_A" in name for name, _ in student.named_parameters())
    own = student_with_targets(folder, ["q_proj", "v_proj", "out_proj"])  # one's own list, without what peft refuses
    assert own.endswith("set model.lora.target_modules=[q_proj,v_proj]")


def test_a_vision_language_checkpoint_without_a_causal_lm_class_says_what_to_give_instead(tmp_path):
    """A model-families audit: Mistral3ForConditionalGeneration (Ministral 3, Mistral Small 3.1) has no class
    AutoModelForCausalLM loads; the line said transformers cannot load it, and nothing to do about it."""
    from transformers import AutoConfig

    folder = tmp_path / "ministral3"
    AutoConfig.for_model("mistral3").save_pretrained(folder)
    (folder / "model.safetensors").write_bytes(b"")  # refused on its config, before any weight is read
    teacher = TeacherConfig(model_id=str(folder), quantization="none")
    with pytest.raises(MiniverlError) as info:
        models.load_teacher(teacher, models.source_of(teacher, None), torch.device("cpu"))
    line = str(info.value)
    assert line.startswith(f"teacher.model_id={folder}: transformers cannot load it (ValueError: Unrecognized ")
    assert line.endswith(
        "it is a vision-language checkpoint whose language model transformers does not load alone: give a "
        "text-only release of the model, or its language model saved on its own"
    )


@pytest.fixture
def console_warnings(monkeypatch) -> list[str]:
    """The lines loading.py writes to the console and main.log (through log_line: caplog misses them once an
    earlier test in the worker has set up Hydra's logging, which stops the logger's propagation)."""
    said: list[str] = []
    monkeypatch.setattr(models, "log_line", lambda logger, line, *args, **kwargs: said.append(line))
    return said


def test_linear_layers_peft_leaves_untrained_under_its_moe_remap_are_named_on_the_console(tmp_path, console_warnings):
    """A model-families audit: peft 0.21.2 takes gate_proj/up_proj/down_proj of GLM-4-MoE (DeepSeek-V3,
    Qwen3-Next) for the experts' 3-D parameters and drops the dense layer's and the shared expert's linear
    layers of those names from all-linear, saying nothing (0.22.0 keeps them); a student adapted on fewer
    layers than asked for is found whatever peft does."""

    from transformers import AutoConfig, AutoModelForCausalLM

    from miniverl.models import toy

    from conftest import family_folder

    tokenizer = toy.build_toy_tokenizer()
    sizes = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    moe = dict(n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, n_group=1, topk_group=1)
    config = AutoConfig.for_model(
        "glm4_moe", vocab_size=len(tokenizer), num_key_value_heads=2, moe_intermediate_size=32, **sizes, **moe
    )
    folder = toy.save_toy(AutoModelForCausalLM.from_config(config), tokenizer, tmp_path / "glm4_moe", "bfloat16")
    student = student_with_targets(folder, "all-linear")
    assert not isinstance(student, str)
    said = [line for line in console_warnings if "untrained" in line]
    missed = adapters.unadapted_layers(student.get_base_model(), "all-linear")
    # peft 0.21.2 drops the dense and shared-expert layers; 0.22.0 (what a fresh install takes) keeps them:
    # the warning follows what the installed peft did.
    if not missed:
        assert said == []
    else:
        assert missed == [f"model.layers.0.mlp.{name}" for name in ("gate_proj", "up_proj", "down_proj")] + [
            f"model.layers.1.mlp.shared_experts.{name}" for name in ("gate_proj", "up_proj", "down_proj")
        ]
        assert said == [
            "model.lora.target_modules=all-linear: peft 0.21.2 leaves 6 linear layers untrained (model.layers.0.mlp."
            "gate_proj, model.layers.0.mlp.up_proj, model.layers.0.mlp.down_proj, model.layers.1.mlp.shared_experts."
            "gate_proj and 2 more): it takes gate_proj, up_proj, down_proj of a glm4_moe model for its experts' "
            "parameters (the adapter's target_parameters) and drops the layers of those names".replace(
                "0.21.2", package_version("peft")
            )
        ]
    # The detection itself, whatever peft does: a student adapted on q_proj only, asked for all-linear.
    llama = family_folder("llama", tmp_path, seed=0)
    console_warnings.clear()
    assert adapters.unadapted_layers(student_with_targets(llama, "all-linear").get_base_model(), "all-linear") == []
    partial = student_with_targets(llama, ["q_proj"]).get_base_model()
    assert adapters.unadapted_layers(partial, ["q_proj"]) == [] and console_warnings == []
    missed = adapters.unadapted_layers(partial, "all-linear")
    assert {name.rsplit(".", 1)[-1] for name in missed} == {
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    }
    assert len(missed) == 6 * 2 and not any("q_proj" in name or "lora_" in name for name in missed)


def test_a_family_whose_linear_layers_nf4_leaves_in_bf16_is_said_so(tmp_path, console_warnings):
    """A model-families audit: Falcon's layers are FalconLinear, a subclass transformers does not quantize
    (it takes nn.Linear and Conv1D); the run said NF4 and held them in bf16. Llama's all quantize."""
    from conftest import family_folder

    def warnings_of(family: str) -> list[str]:
        console_warnings.clear()
        teacher = TeacherConfig(model_id=str(family_folder(family, tmp_path, 1)), quantization="nf4", dtype="bfloat16")
        models.load_teacher(teacher, models.source_of(teacher, None), torch.device("cpu"), use_nf4_cache=False)
        return [said for said in console_warnings if "under NF4" in said]

    assert warnings_of("falcon") == [
        "teacher: 100% of the linear weights (8 layers: FalconLinear) stay in torch.bfloat16 under NF4: transformers "
        "quantizes nn.Linear and Conv1D, not a family's own subclass; the memory estimate (pre-flight) counted them "
        "as 4-bit"
    ]
    assert warnings_of("llama") == []


class _GroupedLinear(torch.nn.Linear):
    def forward(self, x):  # DeepSeek-V4's o_a_proj: one tensor, grouped: (..., groups, out / groups)
        out = super().forward(x)
        return out.view(*out.shape[:-1], 4, out.shape[-1] // 4)


class _PlainLinear(torch.nn.Linear):
    def forward(self, x):  # Falcon's FalconLinear: a plain product, written by the family
        return x @ self.weight.T


for _kind in (_GroupedLinear, _PlainLinear):  # a family's own layers, as transformers' modeling files define them
    _kind.__module__ = "transformers.models.family.modeling_family"


def test_a_familys_own_linear_layer_is_refused_only_where_its_forward_is_not_a_linear_layers(tmp_path):
    """A model-families audit: every Falcon layer (FalconLinear, a plain product) was refused as a MoE router,
    with a fix, [], that was refused in turn; a layer whose output is grouped must still be refused."""
    from miniverl.models.adapters import routers_problem

    from conftest import family_folder

    model = AutoModelForCausalLM.from_pretrained(family_folder("llama", tmp_path, 0))
    attention = model.model.layers[0].self_attn
    for kind, refused in ((_PlainLinear, False), (_GroupedLinear, True)):
        attention.o_proj.__class__ = kind
        line = routers_problem(model, "all-linear")
        assert (line is not None) is refused
    assert line == (
        "model.lora.target_modules=all-linear: o_proj (_GroupedLinear) returns other than the (rows, out_features) "
        "tensor of a linear layer (a MoE router's tuple), which LoRA cannot wrap; set "
        "model.lora.target_modules=[q_proj,k_proj,v_proj,gate_proj,up_proj,down_proj]"
    )
    assert attention.o_proj.training == model.training  # the probe left the layer's mode as it was
    falcon = AutoModelForCausalLM.from_pretrained(family_folder("falcon", tmp_path, 0))
    assert routers_problem(falcon, "all-linear") is None


def test_lora_targets_that_take_a_moe_router_are_refused_with_the_list_that_leaves_it_out(tmp_path):
    """A model-families audit: Phi-3.5-MoE's router is a linear layer of its own class that returns a tuple;
    all-linear wrapped it and the first rollout ended in a traceback ('tuple' object has no attribute 'dtype')."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from miniverl.models import toy

    tokenizer = toy.build_toy_tokenizer()
    sizes = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    config = AutoConfig.for_model(
        "phimoe", vocab_size=len(tokenizer), num_key_value_heads=2, num_local_experts=2, **sizes
    )
    folder = toy.save_toy(AutoModelForCausalLM.from_config(config), tokenizer, tmp_path / "phimoe", "bfloat16")
    line = student_with_targets(folder, "all-linear")
    assert line.startswith(
        "model.lora.target_modules=all-linear: router (PhimoeTopKRouter) returns other than the (rows, "
        "out_features) tensor of a linear layer (a MoE router's tuple)"
    )
    listed = fixed_list(line)
    assert "router" not in listed and {"q_proj", "o_proj"} <= set(listed)
    assert student_with_targets(folder, ["q_proj", "router"]).endswith("set model.lora.target_modules=[q_proj]")
    student = student_with_targets(folder, listed)
    ids = torch.tensor([[1, 2, 3]])
    assert student(input_ids=ids).logits.shape == (1, 3, len(tokenizer))


def test_the_decoder_stack_of_a_model_whose_get_decoder_returns_itself_is_the_one_inside():
    """A model-families audit: Llama 4's text model (transformers 5.25) returns itself from get_decoder(), and
    the rollout read last_hidden_state off its causal-LM output (an AttributeError traceback)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    sizes = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=300)
    llama4 = AutoConfig.for_model("llama4_text", intermediate_size_mlp=128, num_key_value_heads=2, head_dim=16, **sizes)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(llama4)
        llama = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", num_key_value_heads=2, **sizes))
    assert model.get_decoder() is model and models.decoder_of(model) is model.model
    assert models.decoder_of(llama) is llama.get_decoder() is llama.model


def test_a_model_folder_saved_without_its_tokenizer_is_named_as_such(tmp_path):
    """config.json and the weights, no tokenizer files (a model saved alone): the line says what is
    missing and the two ways to fix it, not transformers' cut-off "Couldn't instantiate the backend"."""
    folder = tmp_path / "weights-only"
    assert tokenizer_refusal(folder, {"config.json": '{"model_type": "llama"}', "model.safetensors": ""}) == (
        f"model.model_id={folder} holds no tokenizer (none of tokenizer*, *.model, *.tiktoken, tekken.json, vocab.*, "
        "merges.txt): save the model's tokenizer there (tokenizer.save_pretrained(folder)), or set model.tokenizer_id "
        "to one"
    )


def test_a_folder_with_neither_config_nor_tokenizer_is_named_no_model_not_only_no_tokenizer(tmp_path):
    folder = tmp_path / "notes"
    line = tokenizer_refusal(folder, {"README.md": "not a model"})
    assert line.startswith(f"model.model_id={folder} is a folder but not a model (")
    assert line.endswith("config.json, the weights (*.safetensors) and the tokenizer's files")


def test_a_cached_hub_model_transformers_cannot_read_is_not_called_missing():
    source = models.Source("someone/new-arch", None, "someone/new-arch", None)
    line = str(models.offline_error("teacher", source, ValueError("Unrecognized model in someone/new-arch")))
    assert line == (
        "teacher.model_id=someone/new-arch: transformers cannot load it (ValueError: Unrecognized model in "
        "someone/new-arch); a model type newer than this transformers needs an upgrade; one with its own code, "
        "trust_remote_code: teacher.trust_remote_code=true"
    )


def test_a_model_folder_under_a_tilde_is_the_one_in_home(toy_dirs, monkeypatch):
    """`model_id: ~/models/x` (quoted on the command line, or in a recipe) as a shell expands it."""
    teacher = toy_dirs["teacher"]
    monkeypatch.setenv("HOME", str(teacher.parent))
    block = TeacherConfig(model_id=f"~/{teacher.name}", tokenizer_id=f"~/{teacher.name}")
    source = models.source_of(block, None)
    assert source.path == source.tokenizer_path == str(teacher)
    loaded = models.load_tokenizer("teacher", block, source)
    assert loaded.get_vocab() == models.toy.build_toy_tokenizer("bytes").get_vocab()


def test_a_missing_tokenizer_folder_is_named_by_its_own_settings(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    block = StudentConfig(model_id="toy", tokenizer_id="outputs/a/tokenizer", tokenizer_revision="abc")
    with pytest.raises(MiniverlError) as info:
        models.load_tokenizer("model", block, models.source_of(block, tmp_path))
    assert str(info.value).startswith("model.tokenizer_id=outputs/a/tokenizer: no such folder (relative to ")
    hub = StudentConfig(model_id="toy", tokenizer_id="someone/tokenizer", tokenizer_revision="abc")
    with pytest.raises(MiniverlError) as info:
        models.load_tokenizer("model", hub, models.source_of(hub, tmp_path))
    assert str(info.value).startswith("model.tokenizer_id=someone/tokenizer at revision abc cannot be loaded")
    assert str(info.value).endswith("set model.tokenizer_revision=null for another")


def test_a_teacher_with_another_vocabulary_is_refused(toy_dirs, tmp_path):
    from transformers import PreTrainedTokenizerFast

    from miniverl.models import toy

    student_tok = toy.build_toy_tokenizer()
    other = toy.build_toy_tokenizer()
    other.add_tokens(["<extra>"])
    model = AutoModelForCausalLM.from_pretrained(toy_dirs["student"])
    with pytest.raises(MiniverlError, match="vocabularies differ") as refused:
        tokenizers.check_tokenizers_compatible(student_tok, other, model, model)
    assert str(refused.value).endswith("set teacher.tokenizer_alignment=text")
    assert isinstance(other, PreTrainedTokenizerFast)
    with pytest.raises(MiniverlError) as refused:  # the bench's flag: it has no tokenizer_alignment to set
        tokenizers.check_tokenizers_compatible(student_tok, other, model, model, "--teacher")
    assert str(refused.value).startswith("--teacher and student: tokenizer vocabularies differ")
    assert str(refused.value).endswith(
        "the bench measures a pair of one tokenizer: give --teacher a model of the student's"
    )


def test_a_teacher_with_another_chat_template_is_refused(toy_dirs):
    from miniverl.models import toy

    student_tok, teacher_tok = toy.build_toy_tokenizer(), toy.build_toy_tokenizer()
    teacher_tok.chat_template = teacher_tok.chat_template.replace("\n", " ")
    model = AutoModelForCausalLM.from_pretrained(toy_dirs["student"])
    with pytest.raises(MiniverlError, match="chat templates"):
        tokenizers.check_tokenizers_compatible(student_tok, teacher_tok, model, model)


# Gemma-2's instruct template (and Mistral-7B-Instruct v0.1/v0.2's), in the qwen3 toy's own tokens.
NO_SYSTEM_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_a_chat_template_that_refuses_a_system_turn_is_compared_and_read_without_one(tmp_path):
    """An audit: such a template made the doctor and the run a jinja2 traceback (the tokenizer check's
    probe conversation has a system turn), though the data's rows have none."""
    from miniverl.config.data import DataConfig
    from miniverl.models import toy
    from miniverl.utils.dataset import prompt_ids

    student_tok, teacher_tok = toy.build_toy_tokenizer("qwen3"), toy.build_toy_tokenizer("qwen3")
    student_tok.chat_template = teacher_tok.chat_template = NO_SYSTEM_TEMPLATE
    assert tokenizers.tokenizers_differ(student_tok, teacher_tok) is None
    assert tokenizers.assistant_turn_end(student_tok) == student_tok.convert_tokens_to_ids("<|im_end|>")
    teacher_tok = toy.build_toy_tokenizer("qwen3")  # Qwen3's own template takes a system turn
    assert "chat templates render the probe conversation differently" in tokenizers.tokenizers_differ(
        student_tok, teacher_tok
    )
    thinking = toy.build_toy_tokenizer("qwen3")  # the same but for the generation prompt (Qwen3's empty think block)
    thinking.chat_template = NO_SYSTEM_TEMPLATE.replace(
        "assistant\n{% endif %}", "assistant\n<think></think>{% endif %}"
    )
    assert "render the probe conversation" in tokenizers.tokenizers_differ(student_tok, thinking)
    system = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    assert prompt_ids(system[1:], DataConfig(), student_tok)  # the rows a template takes
    with pytest.raises(MiniverlError) as refused:
        prompt_ids(system, DataConfig(), student_tok, "data.train_files row 3")
    assert str(refused.value) == (
        "data.train_files row 3: the chat template refuses this conversation (system/user): System role not "
        "supported; write the rows as the model's template takes them (without a system turn, say), or give the "
        "model another template"
    )
    # Read from a parquet file, as a run and the doctor's data check read it: the row is named.
    import pyarrow as pa
    import pyarrow.parquet as pq

    from miniverl.config import to_config
    from miniverl.trainer.preflight import check_data
    from miniverl.utils.dataset import read_conversations, tokenize_prompts

    from conftest import compose_config

    parquet = tmp_path / "prompts.parquet"
    pq.write_table(pa.table({"prompt": [system[1:], system, system[1:], system[1:]]}), parquet)
    data = DataConfig(train_files=str(parquet))
    with pytest.raises(MiniverlError, match=r"^data.train_files row 1: the chat template refuses this conversation"):
        tokenize_prompts(read_conversations(data), data, student_tok, 128)
    cfg = to_config(compose_config(["+recipe=opd_k1", f"data.train_files={parquet}"]))
    with pytest.raises(MiniverlError, match=r"^data.train_files row 1: the chat template refuses"):
        check_data(cfg, student_tok)


def test_the_stop_ids_before_loading_come_from_the_folders_own_files(tmp_path):
    """The doctor's ids that end a response: the tokenizer's EOS and generation_config.json's
    (Qwen3's layout ends on <|im_end|> and <|endoftext|>); without that file, config.json's."""
    from miniverl.config.model import ToyArchitecture
    from miniverl.models import toy

    tokenizer = toy.build_toy_tokenizer("qwen3")
    model = toy.build_toy_model(ToyArchitecture(tokenizer="qwen3", vocab_rows=151_936), tokenizer, seed=0)
    folder = toy.save_toy(model, tokenizer, tmp_path / "toy")
    block = StudentConfig(model_id=str(folder))
    im_end, endoftext = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    assert tokenizers.configured_stop_ids(tokenizer, models.source_of(block, None)) == sorted([im_end, endoftext])
    assert tokenizers.configured_stop_ids(tokenizer, models.source_of(block, None)) == tokenizers.stop_token_ids(
        tokenizer, AutoModelForCausalLM.from_pretrained(folder)
    )
    (folder / "generation_config.json").unlink()
    from_config = AutoModelForCausalLM.from_pretrained(folder).config.eos_token_id
    expected = sorted({tokenizer.eos_token_id, *([from_config] if isinstance(from_config, int) else from_config)})
    assert tokenizers.configured_stop_ids(tokenizer, models.source_of(block, None)) == expected


def test_stop_ids_that_are_words_or_miss_the_end_of_an_assistant_turn_are_named():
    """A generation config of another tokenizer (Phi-3's 32000 beside SmolLM2's vocabulary: a word
    piece) or one without the template's end of turn (Qwen2's <|endoftext|> alone): the doctor says
    which id and what to change; Qwen3's own two ids fit."""
    from miniverl.models import toy

    tokenizer = toy.build_toy_tokenizer("qwen3")
    im_end, endoftext = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    assert tokenizers.assistant_turn_end(tokenizer) == im_end
    assert tokenizers.stop_ids_problem(tokenizer, [im_end, endoftext]) is None
    missing = tokenizers.stop_ids_problem(tokenizer, [endoftext])
    assert f"ends an assistant turn with '<|im_end|>' (id {im_end}), which does not end a response" in missing
    word = tokenizer("hello", add_special_tokens=False)["input_ids"][0]
    assert word not in tokenizer.all_special_ids
    assert "an ordinary piece of text" in tokenizers.stop_ids_problem(tokenizer, [im_end, word])


def test_all_linear_gives_a_qwen3_student_the_adapter_its_seven_projections_give(toy_dirs):
    """The real recipes name all-linear where they named the seven projections: on a Llama or Qwen
    layer the two are one adapter, to the last initial weight."""
    from miniverl.config.model import LoraSettings

    seven = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

    def initial_lora(targets):
        block = StudentConfig(quantization="none", lora=LoraSettings(target_modules=targets))
        source = models.source_of(block, toy_dirs["student"])
        student = models.load_student(block, source, torch.device("cpu"), lora_seed=3)
        return {name: p.detach() for name, p in student.named_parameters() if "lora_" in name}

    named, all_linear = initial_lora(seven), initial_lora("all-linear")
    assert len(named) == 2 * 7 * StudentConfig().toy.num_layers and named.keys() == all_linear.keys()
    assert all(torch.equal(named[k], all_linear[k]) for k in named)


def test_a_tokenizer_without_a_chat_template_is_refused_with_the_setting_that_borrows_one(tmp_path):
    """A base model's folder often has no chat template; the instruct model's tokenizer has one."""
    import json

    from conftest import family_folder

    folder = family_folder("llama", tmp_path, seed=0)
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    block = StudentConfig(model_id=str(folder))
    with pytest.raises(MiniverlError) as refused:
        models.load_tokenizer("model", block, models.source_of(block, None))
    message = str(refused.value)
    assert "\n" not in message and message.startswith(f"model: the tokenizer of {folder} lacks a chat template; ")
    assert "set model.tokenizer_id to a folder whose tokenizer has it" in message
    instruct = family_folder("llama", tmp_path / "instruct", seed=0)
    block = StudentConfig(model_id=str(folder), tokenizer_id=str(instruct))
    assert models.load_tokenizer("model", block, models.source_of(block, None)).chat_template


def test_a_student_loaded_from_a_relative_folder_names_its_base_absolutely_in_its_adapter(toy_dirs, monkeypatch):
    """adapter_config.json's base_model_name_or_path was `../models/student` as given: the adapter then
    loaded from no other working directory (PeftConfig -> from_pretrained: "Repo id must be ...")."""
    student = toy_dirs["student"]
    monkeypatch.chdir(student.parent)
    block = StudentConfig(model_id=f"../{student.parent.name}/{student.name}", quantization="none")
    source = models.source_of(block, None)
    assert source.path == source.tokenizer_path == str(student)
    loaded = models.load_student(block, source, torch.device("cpu"), lora_seed=0)
    assert loaded.peft_config["default"].base_model_name_or_path == str(student)
    hub = models.source_of(StudentConfig(model_id="Qwen/Qwen3-0.6B"), None)
    assert hub.path == "Qwen/Qwen3-0.6B"  # a hub id is no folder here: as given


def test_a_file_given_as_the_model_folder_is_named_a_file_and_its_folder_offered(toy_dirs, tmp_path):
    """A new-user audit gave model.model_id a file and read "no such folder" for a path that exists."""
    weights = next(toy_dirs["student"].glob("*.safetensors"))
    block = StudentConfig(model_id=str(weights))
    with pytest.raises(MiniverlError) as info:
        models.load_tokenizer("model", block, models.source_of(block, None))
    assert str(info.value) == (
        f"model.model_id={weights} is a file, not a model folder; give its folder: model.model_id={weights.parent}"
    )
    (tmp_path / "notes.txt").write_text("x")
    other = StudentConfig(model_id=str(tmp_path / "notes.txt"))
    with pytest.raises(MiniverlError, match="is a file, not a model folder; give the folder save_pretrained wrote"):
        models.load_tokenizer("model", other, models.source_of(other, None))


def test_a_student_of_a_pinned_hub_model_names_that_commit_in_its_adapter(toy_dirs, tmp_path):
    """adapter_config.json's revision was null: AutoPeftModelForCausalLM would load the base's default branch."""
    from miniverl.utils.checkpoint import save_adapter

    base = AutoModelForCausalLM.from_pretrained(toy_dirs["student"], dtype=torch.float32)
    pinned = StudentConfig(model_id="Qwen/Qwen3-0.6B", revision="c1899de289a04d12100db370d81485cdf75e47ca")
    save_adapter(models.wrap_student(base, pinned, torch.device("cpu"), lora_seed=0), tmp_path / "adapter")
    saved = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert saved["revision"] == "c1899de289a04d12100db370d81485cdf75e47ca"
    local = StudentConfig(model_id=str(toy_dirs["student"]), revision="c1899de289a04d12100db370d81485cdf75e47ca")
    fresh = AutoModelForCausalLM.from_pretrained(toy_dirs["student"], dtype=torch.float32)
    assert models.wrap_student(fresh, local, torch.device("cpu"), lora_seed=0).peft_config["default"].revision is None


def test_a_model_with_code_of_its_own_is_one_line_naming_trust_remote_code(toy_dirs, tmp_path):
    """A new-user audit's custom-code model got transformers' text with no word of the setting that loads it."""
    import shutil

    folder = tmp_path / "custom"
    shutil.copytree(toy_dirs["student"], folder)
    (folder / "configuration_custom.py").write_text(
        "from transformers import Qwen3Config\nclass CustomConfig(Qwen3Config):\n    model_type = 'custom_rc'\n"
    )
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type="custom_rc", auto_map={"AutoConfig": "configuration_custom.CustomConfig"})
    (folder / "config.json").write_text(json.dumps(config))
    block = StudentConfig(model_id=str(folder))
    with pytest.raises(MiniverlError) as info:
        models.load_causal_lm("model", block, models.source_of(block, None), torch.device("cpu"))
    assert str(info.value) == (
        f"model.model_id={folder} runs code of its own, which transformers does not run; if you trust it: "
        "model.trust_remote_code=true"
    )


def test_output_layers_may_pad_past_the_tokenizer_differently_but_not_fall_short_of_it():
    """Qwen2.5-1.5B's 151,936 rows beside Qwen2.5-7B's 152,064 for a 151,665-token tokenizer: padding, never
    sampled or scored (a tests audit: refusing any difference passed every fast test)."""
    from miniverl.models.tokenizers import output_rows_problem

    assert output_rows_problem(151936, 152064, 151665) is None
    assert output_rows_problem(151936, 151936, 151936) is None
    assert output_rows_problem(151936, 151000, 151665) == (
        "the tokenizer has 151665 tokens but the teacher has 151000 output rows: its output layer cannot score "
        "every token id; pick a model of the tokenizer's vocabulary"
    )
