"""The fast paths are exact: the decode loop samples what a straightforward reference loop samples
with the same per-sample streams, over NF4 layers dequantized once per rollout it samples exactly
what bitsandbytes' per-call path samples, the chunked sampled-token log-probs (and their
gradients) equal the naive log-softmax, and `python -m miniverl.bench` writes its ratios under
stable keys."""

from __future__ import annotations

import importlib.util
import json
import math
import shutil
import subprocess
import sys

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from miniverl.config.actor import RolloutConfig
from miniverl.workers import logprobs
from miniverl.workers.logprobs import response_log_probs, sampled_log_probs
from miniverl.workers.rollout import RolloutWorker
from miniverl.workers.rollout.lean_decode import layer_by_layer, lean_decode_modules
from miniverl.workers.rollout.sampling import filter_logits

from conftest import ROOT, family_folder, toy_model_folders

VOCAB, EOS, PAD = 61, 7, 0  # a vocabulary no chunk size divides


def lora_student(architecture: str):
    """A small random student of `architecture` (qwen3 or llama), LoRA on q/v with a non-zero B."""
    config_class, model_class = {"qwen3": (Qwen3Config, Qwen3ForCausalLM), "llama": (LlamaConfig, LlamaForCausalLM)}[
        architecture
    ]
    config = config_class(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        eos_token_id=EOS,
        pad_token_id=PAD,
        bos_token_id=None,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = model_class(config)
    peft_model = get_peft_model(
        model,
        LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, task_type="CAUSAL_LM"),
    )
    with torch.no_grad():  # a non-zero B: the adapter changes the outputs
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.05)
    return peft_model.get_base_model().eval()  # LoRA injected in place, as the rollout sees the student


@pytest.fixture(scope="module")
def model():
    return lora_student("qwen3")


PROMPTS = [[3, 9, 12, 40, 5], [11, 2], [30, 31, 32, 33, 34, 35, 36, 37], [50]]
SEEDS = [101, 202, 303, 404]


def reference_loop(model, prompt, seed, limit, *, temperature, top_k, top_p):
    """One sample, no batch, no padding, no KV cache: the whole sequence through the model at every
    step; the stream's t-th uniform picks the first token whose cumulative probability passes it."""
    u = torch.rand(limit, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    ids, tokens, log_probs = list(prompt), [], []
    with torch.no_grad():
        for step in range(limit):
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1].float() / temperature  # (V,)
            probs = filter_logits(logits[None], top_k, top_p)[0].double().softmax(-1)
            token = int((probs.cumsum(-1) <= u[step]).sum())  # first index whose cumulative sum exceeds u
            tokens.append(token)
            log_probs.append(float(logits.log_softmax(-1)[token]))
            ids.append(token)
            if token == EOS:
                break
    return tokens, log_probs


@pytest.mark.parametrize("static_cache", [False, True])
@pytest.mark.parametrize(
    "sampling", [{"temperature": 1.0, "top_k": -1, "top_p": 1.0}, {"temperature": 0.8, "top_k": 20, "top_p": 0.9}]
)
@pytest.mark.slow
def test_decode_loop_samples_what_the_reference_loop_samples(model, static_cache, sampling):
    limit = 24
    worker = RolloutWorker(
        model,
        RolloutConfig(**sampling),
        eos_ids=[EOS],
        pad_id=PAD,
        device=torch.device("cpu"),
        static_cache=static_cache,
    )
    whole = worker.generate_sequences(PROMPTS, [0, 1, 2, 3], SEEDS, response_limit=limit, physical_batches=[4])
    stopped = 0
    for i, (prompt, seed) in enumerate(zip(PROMPTS, SEEDS)):
        tokens, log_probs = reference_loop(model, prompt, seed, limit, **sampling)
        n = int(whole.response_mask[i].sum())
        assert whole.responses[i, :n].tolist() == tokens
        assert whole.responses[i, n:].eq(PAD).all()
        torch.testing.assert_close(whole.rollout_log_probs[i, :n], torch.tensor(log_probs), rtol=1e-5, atol=1e-5)
        stopped += tokens[-1] == EOS and n < limit
    assert stopped >= 1  # the EOS stop is exercised
    for split in ([1, 3], [2, 1, 1]):
        other = worker.generate_sequences(PROMPTS, [0, 1, 2, 3], SEEDS, response_limit=limit, physical_batches=split)
        assert torch.equal(other.responses, whole.responses) and torch.equal(other.response_mask, whole.response_mask)


def test_a_llama_student_decodes_layer_by_layer_and_samples_what_the_reference_loop_samples():
    """Llama's config has no `layer_types`: its layers are all full attention all the same, so the
    decode step calls them directly with the preallocated boolean mask (SmolLM2 is a Llama)."""
    llama = lora_student("llama")
    worker = RolloutWorker(llama, RolloutConfig(), eos_ids=[EOS], pad_id=PAD, device=torch.device("cpu"))
    assert worker.direct_mask and layer_by_layer(llama.get_decoder())
    whole = worker.generate_sequences(PROMPTS, [0, 1, 2, 3], SEEDS, response_limit=16, physical_batches=[4])
    for i, (prompt, seed) in enumerate(zip(PROMPTS, SEEDS)):
        tokens, log_probs = reference_loop(llama, prompt, seed, 16, temperature=1.0, top_k=-1, top_p=1.0)
        n = int(whole.response_mask[i].sum())
        assert whole.responses[i, :n].tolist() == tokens
        torch.testing.assert_close(whole.rollout_log_probs[i, :n], torch.tensor(log_probs), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(
    not any(shutil.which(cc) for cc in ("g++", "c++", "clang++")),
    reason="inductor compiles C++ on the CPU: no compiler here",
)
@pytest.mark.slow
def test_compiled_decode_step_samples_what_the_eager_loop_samples_on_the_cpu(model, tmp_path, monkeypatch):
    """hardware.rollout_compile through a real torch.compile (inductor; a CUDA graph only on CUDA),
    with the static cache it implies: the same tokens and log-probs as the eager loop."""
    from torch._dynamo.utils import counters

    # A cache of its own: inductor's does not key on ATEN_CPU_CAPABILITY, and a step compiled
    # without the AVX2 kind's caps segfaulted when a capped run reused it (docs/testing.md).
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    counters.clear()
    plain = RolloutWorker(model, RolloutConfig(), eos_ids=[EOS], pad_id=PAD, device=torch.device("cpu"))
    compiled = RolloutWorker(
        model, RolloutConfig(), eos_ids=[EOS], pad_id=PAD, device=torch.device("cpu"), compile_decode=True
    )
    assert compiled.static_cache and compiled.compile_decode
    a = plain.generate_sequences(PROMPTS, [0, 1, 2, 3], SEEDS, response_limit=16, physical_batches=[4])
    for _ in range(2):  # the second rollout reuses the static cache and the compiled step
        b = compiled.generate_sequences(PROMPTS, [0, 1, 2, 3], SEEDS, response_limit=16, physical_batches=[4])
        assert torch.equal(a.responses, b.responses)
        torch.testing.assert_close(a.rollout_log_probs, b.rollout_log_probs, rtol=1e-5, atol=1e-5)
    assert counters["stats"]["unique_graphs"] >= 1  # a graph was captured and compiled, not run eagerly


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_decode_samples_what_the_eager_loop_samples(model):
    cuda = torch.device("cuda")
    gpu_model = model.to(cuda)
    try:
        eager = RolloutWorker(gpu_model, RolloutConfig(), eos_ids=[EOS], pad_id=PAD, device=cuda)
        graph = RolloutWorker(gpu_model, RolloutConfig(), eos_ids=[EOS], pad_id=PAD, device=cuda, compile_decode=True)
        a = eager.generate_sequences(PROMPTS, [0, 1, 2, 3], SEEDS, response_limit=16, physical_batches=[4])
        for _ in range(2):
            b = graph.generate_sequences(PROMPTS, [0, 1, 2, 3], SEEDS, response_limit=16, physical_batches=[4])
            assert torch.equal(a.responses, b.responses)
            torch.testing.assert_close(a.rollout_log_probs, b.rollout_log_probs, rtol=1e-4, atol=1e-4)
    finally:
        model.to("cpu")


@pytest.fixture(scope="module")
def nf4_student(tmp_path_factory):
    """The recipe's student path: a bfloat16 Qwen3 checkpoint loaded by models.load_student (NF4,
    bf16 compute, prepare_model_for_kbit_training, LoRA r16 on q/v), a non-zero LoRA B."""
    from miniverl.config.model import StudentConfig
    from miniverl.models import loading as models
    from miniverl.models import toy

    folder = tmp_path_factory.mktemp("nf4") / "student"
    tokenizer = toy.build_toy_tokenizer()
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=192,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        dtype="bfloat16",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        Qwen3ForCausalLM(config).to(torch.bfloat16).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    block = StudentConfig(model_id=str(folder), dtype="auto", quantization="nf4")
    student = models.load_student(block, models.source_of(block, None), torch.device("cpu"), lora_seed=1)
    with torch.no_grad():
        for name, param in student.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.05, generator=torch.Generator().manual_seed(2))
    return student, tokenizer


def linear_4bit_layers(model):
    import bitsandbytes as bnb

    return [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]


@pytest.mark.parametrize("double_quant", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_a_4bit_layer_dequantized_once_computes_what_bitsandbytes_computes(double_quant, bias):
    import bitsandbytes as bnb

    torch.manual_seed(3)
    dense = torch.nn.Linear(128, 96, bias=bias).to(torch.bfloat16)
    layer = bnb.nn.Linear4bit(
        128, 96, bias=bias, compute_dtype=torch.bfloat16, quant_type="nf4", compress_statistics=double_quant
    )
    layer.weight = bnb.nn.Params4bit(
        dense.weight.data.clone(), requires_grad=False, quant_type="nf4", compress_statistics=double_quant
    )._quantize("cpu")
    if bias:
        layer.bias = torch.nn.Parameter(dense.bias.data.clone(), requires_grad=False)
    layer.support_avx512bf16_for_cpu = False  # as models.disable_cpu_nf4_repack leaves every NF4 layer
    layer.eval()
    shell = torch.nn.Sequential(layer)
    for shape in ((4, 1, 128), (3, 17, 128)):  # a decode step, a prefill
        x = torch.randn(*shape)  # float32 in, as the recipe's (float32) norms hand it over
        with torch.inference_mode():
            expected = layer(x)
            with lean_decode_modules(shell, few_row_gemv=True, dequantize_4bit=True) as lean:
                assert "forward" in vars(layer) and lean.dequantized_layers == 1
                assert lean.dequantized_bytes == 96 * 128 * 2  # one bfloat16 copy
                got = layer(x)
        assert "forward" not in vars(layer)  # bitsandbytes' own forward again
        assert got.dtype == expected.dtype == torch.float32 and torch.equal(got, expected)


def test_nf4_rollout_dequantized_once_samples_what_the_per_call_path_samples(nf4_student):
    """Over the recipe's NF4 student: the same tokens and, bitwise, the same log-probs with every
    weight dequantized once per rollout as with bitsandbytes dequantizing on every call; and the
    actor's recompute (its eval pass, and the update's train-mode forward with gradients through
    bitsandbytes' per-call path) agrees with the rollout's log-probs."""
    from miniverl.config.actor import ActorConfig
    from miniverl.config.estimator import EstimatorConfig
    from miniverl.workers.actor import ActorWorker

    student, tokenizer = nf4_student
    base = student.get_base_model()
    layers = linear_4bit_layers(base)
    assert len(layers) == 2 * 7 and all(m.compute_dtype == torch.bfloat16 for m in layers)
    worker = RolloutWorker(
        base,
        RolloutConfig(),
        eos_ids=[tokenizer.eos_token_id],
        pad_id=tokenizer.pad_token_id,
        device=torch.device("cpu"),
    )
    limit = 24
    once = worker.generate_sequences(PROMPTS, [0, 1, 2, 3], SEEDS, response_limit=limit, physical_batches=[4])
    assert worker.last_decode.dequantized_bytes == sum(m.out_features * m.in_features * 2 for m in layers)
    assert not any("forward" in vars(m) for m in base.modules())  # every forward restored
    worker.dequantize_4bit_once = False  # hardware.rollout_dequantize_4bit_once=false
    per_call = worker.generate_sequences(PROMPTS, [0, 1, 2, 3], SEEDS, response_limit=limit, physical_batches=[4])
    assert worker.last_decode.dequantized_bytes == 0
    assert torch.equal(once.responses, per_call.responses)
    assert torch.equal(once.response_mask, per_call.response_mask)
    assert torch.equal(once.rollout_log_probs, per_call.rollout_log_probs)

    k1 = EstimatorConfig(loss_mode="k1", use_policy_gradient=True)
    actor = ActorWorker(student, ActorConfig(), k1, temperature=1.0, logprob_chunk=16, loss_scale_factor=limit)
    mask = once.response_mask
    torch.testing.assert_close(actor.compute_log_prob(once, 4), once.rollout_log_probs, rtol=1e-5, atol=1e-5)
    student.train()  # gradient checkpointing on, bitsandbytes' autograd path
    try:
        with torch.enable_grad():
            trained = response_log_probs(base, once, chunk=16)
        assert trained.requires_grad
    finally:
        student.eval()
    torch.testing.assert_close(trained.detach() * mask, once.rollout_log_probs, rtol=1e-5, atol=1e-5)


def naive(head, hidden, tokens, temperature):
    return torch.log_softmax(head(hidden).float() / temperature, -1).gather(-1, tokens[..., None]).squeeze(-1)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("bias", [False, True])
def test_chunked_log_probs_and_gradients_equal_the_naive_ones(temperature, bias):
    torch.manual_seed(1)
    vocab, chunk = 1009, 7  # 3 x 11 = 33 positions: the last chunk is partial, 7 divides neither
    head = torch.nn.Linear(24, vocab, bias=bias).requires_grad_(False)
    hidden = torch.randn(3, 11, 24, requires_grad=True)
    tokens = torch.randint(0, vocab, (3, 11))
    weights = torch.randn(3, 11)
    expected = naive(head, hidden, tokens, temperature)
    (expected_grad,) = torch.autograd.grad((expected * weights).sum(), hidden)
    with torch.no_grad():
        torch.testing.assert_close(
            sampled_log_probs(head, hidden, tokens, temperature=temperature, chunk=chunk),
            expected,
            rtol=1e-5,
            atol=1e-5,
        )
    for trainable_head in (False, True):  # the fused-gradient path, then the checkpointed one
        head.weight.requires_grad_(trainable_head)
        got = sampled_log_probs(head, hidden, tokens, temperature=temperature, chunk=chunk)
        torch.testing.assert_close(got, expected.detach(), rtol=1e-5, atol=1e-5)
        (grad,) = torch.autograd.grad((got * weights).sum(), hidden)
        torch.testing.assert_close(grad, expected_grad, rtol=1e-5, atol=1e-6)


def test_chunks_are_capped_by_the_vocabulary(monkeypatch):
    assert logprobs.rows_per_chunk(256, 151936) == 110 and logprobs.rows_per_chunk(256, 259) == 256
    assert logprobs.rows_per_chunk(256, 10**9) == 1
    monkeypatch.setattr(logprobs, "MAX_CHUNK_ELEMENTS", 3 * 1009)  # 3 positions per chunk
    torch.manual_seed(2)
    head = torch.nn.Linear(8, 1009, bias=False)
    hidden, tokens = torch.randn(2, 5, 8), torch.randint(0, 1009, (2, 5))
    with torch.no_grad():
        torch.testing.assert_close(
            sampled_log_probs(head, hidden, tokens, chunk=256), naive(head, hidden, tokens, 1.0), rtol=1e-5, atol=1e-5
        )


def test_response_log_probs_equal_a_plain_forward(model):
    worker = RolloutWorker(model, RolloutConfig(), eos_ids=[EOS], pad_id=PAD, device=torch.device("cpu"))
    batch = worker.generate_sequences(PROMPTS, [0, 1, 2, 3], SEEDS, response_limit=12, physical_batches=[4])
    with torch.no_grad():
        logits = model(
            input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids
        ).logits
        P, R = batch.prompt_length, batch.response_length
        full = logits[:, P - 1 : P - 1 + R].float().log_softmax(-1).gather(-1, batch.responses[..., None]).squeeze(-1)
        ours = response_log_probs(model, batch, chunk=5)
    mask = batch.response_mask
    torch.testing.assert_close(ours * mask, full * mask, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(batch.rollout_log_probs, full * mask, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_bench_toy_smoke_run_writes_every_ratio(tmp_path):
    from miniverl.bench.setups import PATH_RATIO_KEYS, RATIO_KEYS, TARGETS

    out = tmp_path / "bench"
    done = subprocess.run(
        [sys.executable, "-m", "miniverl.bench", "--scale", "toy", "--repeats", "1", "--out", str(out)],
        check=False,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((out / "bench.json").read_text())
    assert result["schema"] == "miniverl-bench/2" and result["scale"] == "toy"
    assert result["paths"] == ["recipe", "float32"]  # the recipe's own path is the default's headline
    assert set(result["ratios"]) == set(RATIO_KEYS)
    assert {
        "recipe_rollout_vs_hf_generate",
        "recipe_opd_step_vs_trl",
        "recipe_opd_step_vs_trl_k1",
        "recipe_rollout_vs_one_row_generate",
        "recipe_rollout_vs_per_call_dequantize",
    } <= set(RATIO_KEYS)
    assert set(PATH_RATIO_KEYS["float32"]) == {
        "rollout_vs_hf_generate",
        "rollout_vs_one_row_generate",
        "scoring_time_vs_naive",
        "scoring_peak_memory_vs_naive",
        "opd_step_vs_trl",
        "update_vs_bare_fwd_bwd",
    }  # today's keys
    assert "rollout_vs_no_cache" not in result["ratios"]  # the no-KV-cache baseline is gone
    assert TARGETS["recipe_rollout_vs_hf_generate"] == (">=", 2.0) and TARGETS["recipe_opd_step_vs_trl"] == ("<=", 0.5)
    for key, value in result["ratios"].items():
        assert (isinstance(value, float) and math.isfinite(value) and value > 0) or (
            value is None and key in result["null_reasons"]
        ), key
    with_trl = importlib.util.find_spec("trl") is not None  # the optional extra .[bench]
    for key in (
        "recipe_rollout_vs_hf_generate",
        "recipe_rollout_vs_per_call_dequantize",
        *(("recipe_opd_step_vs_trl", "recipe_opd_step_vs_trl_k1") if with_trl else ()),
    ):
        assert isinstance(result["ratios"][key], float) and result["ratios"][key] > 0, result["null_reasons"]
    recipe = result["measurements"]["recipe"]
    assert recipe["rollout"]["miniverl"]["same_tokens_and_log_probs_as_per_call_dequantize"] is True
    assert (
        recipe["rollout"]["miniverl"]["dequantized_bytes"] > recipe["rollout"]["miniverl"]["four_bit_storage_bytes"] > 0
    )
    assert "NF4" in result["settings"]["models"]["recipe"]["student"]
    for path in ("recipe", "float32"):
        assert result["measurements"][path]["scoring"]["max_abs_diff_vs_naive"] < 1e-4
    table = (out / "bench.md").read_text()
    assert "| measurement | miniverl | other |" in table and table.count("\n|") >= 18
    assert "full-vocabulary" in table and "IWOPDTrainer" in table
    # The slowest method runs fewer rounds than the header's: its row says how many (pieces.bench_rollout).
    assert f"best of {len(recipe['rollout']['one_row_generate']['runs'])} rounds, the slowest method" in table
    # A smoke run judges no target (a new-user audit read its "no" rows as the bench's verdict).
    assert "Scale `toy` is a smoke run" in table and "| yes |" not in table and "| no |" not in table


@pytest.mark.slow
def test_bench_measures_a_users_own_model_folders(tmp_path):
    """--student/--teacher: the real path on any two Hugging Face folders (here toy bf16 Qwen3s in
    Qwen3's token layout), its three keys measured, the decode's bytes against the bandwidth."""
    from miniverl.bench.setups import PATH_RATIO_KEYS, TARGETS

    folders = toy_model_folders(tmp_path)
    out = tmp_path / "bench"
    command = [sys.executable, "-m", "miniverl.bench", "--student", str(folders["student"])]
    command += ["--teacher", str(folders["teacher"]), "--repeats", "1", "--no-trl", "--out", str(out)]
    done = subprocess.run(command, check=False, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((out / "bench.json").read_text())
    assert result["paths"] == ["real"] and result["scale"] == "real"
    for key in ("real_rollout_vs_hf_generate", "real_scoring_vs_hf_forward", "real_update_vs_bare_fwd_bwd"):
        assert key in PATH_RATIO_KEYS["real"] and key in TARGETS
        assert isinstance(result["ratios"][key], float) and result["ratios"][key] > 0, key
    assert result["null_reasons"]["recipe_rollout_vs_hf_generate"].startswith("not measured")
    decode = result["measurements"]["real"]["rollout"]["miniverl"]["decode"]
    assert decode["weight_bytes_per_step"] > decode["weight_bytes_per_token"] > 0
    assert 0 < decode["fraction_of_bandwidth"] < 1.5 and decode["memory_bandwidth_bytes_per_s"] > 0
    assert result["measurements"]["real"]["scoring"]["max_abs_diff_vs_naive"] < 1e-4
    table = (out / "bench.md").read_text()
    assert "teacher scoring positions/s vs one plain forward" in table and "memory bandwidth" in table
    assert "not measured" not in table  # other paths' nulls stay in bench.json


@pytest.mark.parametrize(
    "family,targets,attention", [("phi3", "all-linear", "sdpa"), ("gemma2", "q_proj, v_proj", "eager")]
)
def test_the_bench_loads_a_family_without_q_v_or_sdpa_with_what_it_has_and_says_so(
    tmp_path, family, targets, attention
):
    """Phi-3 has no q_proj/v_proj (the bench's LoRA takes all-linear there), Gemma-2 no SDPA
    attention in transformers (eager on both sides); the setup says which it took."""
    from miniverl.bench.setups import build_real_setup
    from miniverl.bench.tables import lora_layers

    student, teacher = (family_folder(family, tmp_path, seed) for seed in (0, 1))
    setup = build_real_setup(str(student), str(teacher), torch.device("cpu"))
    assert setup.lora_targets == (targets if targets == "all-linear" else targets.split(", "))
    assert lora_layers(setup.lora_targets) == ("all-linear" if family == "phi3" else "q/v")  # bench.md's headline
    assert f"LoRA r16 on {targets}," in setup.description["student"]
    assert (
        f"{attention} attention" in setup.description["student"]
        and f"{attention} attention" in setup.description["teacher"]
    )
    assert setup.student.get_base_model().config._attn_implementation == attention


def test_bench_refuses_half_of_a_model_pair():
    from miniverl.bench.cli import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--student", "/some/folder"])


def test_bench_refuses_a_folder_that_is_not_a_model_in_one_line(tmp_path, capsys):
    from miniverl.bench.cli import main

    status = main(["--student", str(tmp_path / "nowhere"), "--teacher", str(tmp_path), "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip()
    assert status == 2 and "\n" not in err
    assert err.startswith(f"miniverl.bench: error: --student {tmp_path / 'nowhere'}: not a Hugging Face model folder")


def test_a_ctrl_c_during_the_bench_is_one_line_and_exit_130(tmp_path, capsys, monkeypatch):
    from miniverl.bench import cli

    def measured(args, out):
        assert out.is_dir()
        raise KeyboardInterrupt  # as Ctrl-C raises it, mid-measurement

    monkeypatch.setattr(cli, "run", measured)
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    status = cli.main(["--out", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip()
    assert status == 130 and err == (
        "miniverl.bench: error: stopped by SIGINT before the bench finished (its results are written at the end): "
        "run it again"
    )
    assert not (tmp_path / "o").exists()  # nothing written there: the folder the bench made is gone


def test_bench_on_cuda_without_a_gpu_is_one_line(tmp_path, capsys, monkeypatch):
    from miniverl.bench.cli import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    status = main(["--device", "cuda", "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip()
    assert status == 2 and "\n" not in err
    assert err.startswith("miniverl.bench: error: --device cuda: torch sees no GPU") and err.endswith(
        "use --device cpu"
    )


def test_the_decode_reads_the_lm_heads_float16_copy_instead_of_its_float32_weight():
    from miniverl.bench.pieces import decode_weight_bytes

    config = LlamaConfig(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, tie_word_embeddings=True,
    )  # fmt: skip
    model = LlamaForCausalLM(config)  # float32, the lm_head tied to the embedding: read once a step
    every = sum(p.numel() * 4 for p in model.parameters())
    assert decode_weight_bytes(model, 0) == every
    head = 256 * 32
    assert decode_weight_bytes(model, 0, fp16_head_bytes=head * 2) == every - head * 4 + head * 2


def test_the_peers_copy_as_shipped_repacks_only_layers_bitsandbytes_can_repack():
    """A family audit: the bench's peers (generate, TRL) run bitsandbytes' own AVX512-BF16 repack, which asserts
    32-row blocks and an even width; Jamba's x_proj (24 rows) crashed the bench in a traceback. Those layers
    keep the dequantize path in the copy; the others are handed back to bitsandbytes."""
    import bitsandbytes as bnb
    from bitsandbytes.functional import has_avx512bf16

    from miniverl.bench.setups import as_shipped
    from miniverl.utils.device import cpu_bf16_instructions

    if not has_avx512bf16() or cpu_bf16_instructions() is None:
        pytest.skip("the copy is needed only where bitsandbytes repacks for bf16 instructions")

    def nf4(rows: int, width: int):
        layer = bnb.nn.Linear4bit(width, rows, bias=False, compute_dtype=torch.bfloat16, quant_type="nf4")
        weight = torch.randn(rows, width, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
        layer.weight = bnb.nn.Params4bit(weight, requires_grad=False, quant_type="nf4")._quantize("cpu")
        layer.support_avx512bf16_for_cpu = False  # as miniverl's loader leaves every NF4 layer
        return layer

    model = torch.nn.Sequential(nf4(128, 64), nf4(24, 128))  # x_proj's 24 rows cannot be repacked
    twin = as_shipped(model, torch.device("cpu")).eval()
    assert [layer.support_avx512bf16_for_cpu for layer in twin] == [True, False]
    with torch.inference_mode():
        assert twin(torch.randn(3, 64)).shape == (3, 24)  # bitsandbytes' own path where it repacks, no assertion
