"""The recipe at Qwen3's layout and precision: bf16 compute over NF4 weights, tied embeddings
padded past a 151,669-id tokenizer, grouped KV heads, Qwen3's added tokens and a generation
config ending on two EOS ids (the toy built in that layout, narrow and shallow)."""

from __future__ import annotations

import copy
import json

import bitsandbytes as bnb
import pytest
import torch
from transformers import AutoModelForCausalLM

from miniverl.config import to_config
from miniverl.models import cpu_gemm, precision, tokenizers, toy
from miniverl.models import loading as models
from miniverl.trainer import memory_estimate, model_checks
from miniverl.trainer.opd_trainer import OPDTrainer
from miniverl.trainer.resume_check import first_difference
from miniverl.trainer.runner import run
from miniverl.utils import device as device_module
from miniverl.utils.errors import MiniverlError
from miniverl.utils.identity import resolved_config
from miniverl.workers.teacher import TeacherWorker

from conftest import compose_config, main

QWEN3 = [
    "+recipe=opd_k1",
    "model=toy_qwen3",
    "teacher=toy_qwen3",
    "hardware=cpu",
    "recipe.optimizer_updates=3",
    "recipe.interrupt_after_updates=null",
    "recipe.response_limit=16",
    "trainer.progress_bar=false",
]
ENDOFTEXT, IM_START, IM_END, THINK, END_THINK = 151_643, 151_644, 151_645, 151_667, 151_668
TOKENS, ROWS = 151_669, 151_936


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    cfg = compose_config(QWEN3)
    trainer = OPDTrainer(to_config(cfg), resolved_config(cfg), tmp_path_factory.mktemp("qwen3"))
    trainer.setup()
    with torch.no_grad():  # a non-zero LoRA B, so that the adapter carries signal
        g = torch.Generator().manual_seed(0)
        for name, param in trainer.student.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=g) * 0.05)
    return trainer


def rollout(trainer, response_limit=16):
    update = trainer.plan.updates[0]
    return trainer.rollout.generate_sequences(
        trainer.prompts.token_ids_of(update.prompt_rows),
        list(update.prompt_rows),
        list(update.sample_seeds),
        response_limit=response_limit,
        physical_batches=[4],
    )


@pytest.fixture(scope="module")
def scored(trainer):
    return trainer.teacher.compute_teacher_log_prob(rollout(trainer), 4)


@pytest.mark.slow
def test_the_qwen3_toy_has_qwen3s_tokens_shapes_and_precision(trainer):
    tok, student = trainer.tokenizer, trainer.student.get_base_model()
    assert len(tok) == TOKENS and tok.eos_token_id == IM_END and tok.pad_token_id == ENDOFTEXT
    assert tok.convert_tokens_to_ids(["<|im_start|>", "<think>", "</think>"]) == [IM_START, THINK, END_THINK]
    config = student.config
    assert config.vocab_size == ROWS and config.num_key_value_heads < config.num_attention_heads
    assert config.head_dim != config.hidden_size // config.num_attention_heads
    assert student.get_output_embeddings().weight is student.get_input_embeddings().weight  # tied
    assert sorted(student.generation_config.eos_token_id) == [ENDOFTEXT, IM_END]
    assert tokenizers.stop_token_ids(tok, student) == [ENDOFTEXT, IM_END]
    saved = json.loads((trainer.run_dir / "toy_models" / "student" / "config.json").read_text())
    assert saved["dtype"] == "bfloat16" and saved["tie_word_embeddings"] is True
    # bf16 compute over NF4 in both models, as the recipe loads Qwen3 (dtype: auto).
    nf4 = [m for m in student.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert nf4 and {m.compute_dtype for m in nf4} == {torch.bfloat16}
    assert precision.least_precise_dtype(student) == torch.bfloat16
    assert precision.least_precise_dtype(trainer.teacher.model) == torch.bfloat16
    prompt = [{"role": "user", "content": "2+2?"}]
    thinking_off = tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False, enable_thinking=False)
    assert thinking_off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False).endswith("assistant\n")


def test_rollout_and_actor_log_probs_agree_within_the_bf16_tolerance(trainer, scored):
    worst_allowed, mean_allowed = precision.log_prob_tolerance(torch.bfloat16)
    mask = scored.response_mask
    actor = trainer.actor.compute_log_prob(scored, rows_per_forward=4)
    own = TeacherWorker(
        trainer.student.get_base_model(), logprob_chunk=64, topk=None, tokenizer_vocab=len(trainer.tokenizer)
    ).compute_teacher_log_prob(copy.copy(scored), 4)
    for other in (actor, own.teacher_logprobs):
        diff = (scored.rollout_log_probs - other) * mask
        assert float(diff.abs().max()) <= worst_allowed
        assert abs(float(diff.sum() / mask.sum())) <= mean_allowed
    # The teacher is another model: its log-probs differ from the student's by far more.
    assert float(((scored.rollout_log_probs - scored.teacher_logprobs) * mask).abs().max()) > worst_allowed


def test_loss_gradients_and_old_log_probs_do_not_depend_on_the_update_chunks_in_bf16(trainer, scored):
    worst_allowed, _ = precision.log_prob_tolerance(torch.bfloat16)
    actor, results = trainer.actor, []
    for chunks in ([4], [2, 2], [1, 1, 1, 1]):
        batch = copy.copy(scored)
        batch.old_log_probs = None  # the update's own forward gives them
        metrics, per_token, own_log_probs = actor.accumulate_gradients(batch, chunks)
        grads = {n: p.grad.clone() for n, p in trainer.student.named_parameters() if p.requires_grad}
        results.append((metrics["actor/distillation/loss"], own_log_probs, per_token, grads))
    actor.optimizer.zero_grad(set_to_none=True)
    loss, old, per_token, grads = results[0]
    assert any(g.abs().sum() > 0 for g in grads.values())
    for other_loss, other_old, other_per_token, other_grads in results[1:]:
        assert other_loss == pytest.approx(loss, rel=1e-2, abs=1e-4)
        assert float((other_old - old).abs().max()) <= worst_allowed
        assert float((other_per_token - per_token).abs().max()) <= worst_allowed
        for name, grad in grads.items():
            assert float((other_grads[name] - grad).abs().max() / grad.abs().max()) <= 1e-2, name


def boost(lm_head, columns, steps=None):
    """A forward hook that makes `columns` of the logits overwhelmingly likely (at the given
    call numbers of the lm_head, or at every call)."""
    calls = iter(range(10**9))

    def hook(module, args, output):
        if steps is None or next(calls) in steps:
            output = output.clone()
            output[..., columns] += 1e4
        return output

    return lm_head.register_forward_hook(hook)


def test_a_row_stops_at_every_eos_id_of_the_generation_config(trainer):
    lm_head = trainer.rollout.model.get_output_embeddings()
    plain = rollout(trainer, response_limit=8)
    handle = boost(lm_head, ENDOFTEXT, steps={2})  # `<|endoftext|>`, not the tokenizer's EOS, at step 2
    try:
        stopped = rollout(trainer, response_limit=8)
    finally:
        handle.remove()
    assert torch.equal(stopped.responses[:, :2], plain.responses[:, :2])
    assert (stopped.responses[:, 2] == ENDOFTEXT).all() and (stopped.response_mask.sum(-1) == 3).all()
    assert stopped.response_length == 3  # nothing sampled after it: no row trains on tokens past its end


def test_padding_rows_are_never_sampled_nor_scored(trainer, scored):
    """Rows past the tokenizer, however likely the model makes them, change no role's distribution."""
    lm_head = trainer.rollout.model.get_output_embeddings()
    teacher_head = trainer.teacher.model.get_output_embeddings()
    plain_actor = trainer.actor.compute_log_prob(scored, rows_per_forward=4)
    handles = [boost(lm_head, slice(TOKENS, None)), boost(teacher_head, slice(TOKENS, None))]
    try:
        boosted = rollout(trainer)
        rescored = trainer.teacher.compute_teacher_log_prob(copy.copy(boosted), 4)
        actor = trainer.actor.compute_log_prob(scored, rows_per_forward=4)
    finally:
        for handle in handles:
            handle.remove()
    assert int(boosted.responses.max()) < TOKENS
    assert torch.equal(boosted.responses, scored.responses)
    assert torch.equal(boosted.rollout_log_probs, scored.rollout_log_probs)
    assert torch.equal(rescored.teacher_logprobs, scored.teacher_logprobs)
    assert torch.equal(actor, plain_actor)


def test_a_teacher_padded_to_another_row_count_is_accepted_and_scores_the_same(trainer, scored):
    tok = trainer.tokenizer
    dense = AutoModelForCausalLM.from_pretrained(trainer.run_dir / "toy_models" / "teacher", dtype=torch.float32)
    padded = copy.deepcopy(dense)
    padded.resize_token_embeddings(152_064, mean_resizing=False)  # Qwen2.5-7B's row count
    tokenizers.check_tokenizers_compatible(tok, tok, trainer.student.get_base_model(), padded)
    scores = [
        TeacherWorker(m, logprob_chunk=64, topk=None, tokenizer_vocab=len(tok))
        .compute_teacher_log_prob(copy.copy(scored), 4)
        .teacher_logprobs
        for m in (dense, padded)
    ]
    assert torch.equal(scores[0], scores[1])
    short = copy.deepcopy(dense)
    short.resize_token_embeddings(TOKENS - 100, mean_resizing=False)  # a real vocabulary difference
    with pytest.raises(MiniverlError, match="cannot score every token id") as info:
        tokenizers.check_tokenizers_compatible(tok, tok, trainer.student.get_base_model(), short)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("float32_gemm", [True, False], ids=["cpu_float32_gemm", "bitsandbytes_products"])
@pytest.mark.slow
def test_the_doctor_passes_the_recipes_precision_and_fails_a_broken_nf4_path(trainer, monkeypatch, float32_gemm):
    monkeypatch.setattr(trainer.rollout, "float32_gemm", float32_gemm)
    source = models.source_of(trainer.cfg.model, trainer.run_dir / "toy_models" / "student")
    self_test = model_checks.check_self_test(trainer)
    assert self_test.status == "PASS" and "bfloat16 compute" in self_test.reason
    gradients = model_checks.check_nf4_gradients(trainer, source)
    assert gradients.status == "PASS" and "bfloat16" in gradients.reason
    # An NF4 path that no longer computes its weights: the kernel the products go through.
    if float32_gemm:
        real = cpu_gemm.dequantized_weight
        monkeypatch.setattr(cpu_gemm, "dequantized_weight", lambda module: real(module) * 1.01)
    else:
        real = bnb.matmul_4bit
        monkeypatch.setattr(bnb, "matmul_4bit", lambda A, B, *args, **kwargs: real(A, B, *args, **kwargs) * 1.01)
    assert model_checks.check_nf4_gradients(trainer, source).status == "FAIL"


def test_the_memory_estimate_counts_the_tied_embedding_once_in_float32():
    cfg = to_config(compose_config(QWEN3))
    student = memory_estimate.architecture("model", cfg.model)
    assert student["tied"] and student["vocab"] == ROWS and student["dtype"] == "bfloat16"
    linear = student["layers"] * (64 * 32 * (2 * 4 + 2 * 2) + 3 * 64 * 128)
    assert memory_estimate.weight_bytes(student, "nf4", 4) == int(linear * (0.5 + 4 / 64) + ROWS * 64 * 4)
    untied = dict(student, tied=False)
    weight_bytes = memory_estimate.weight_bytes
    assert weight_bytes(untied, "nf4", 4) - weight_bytes(student, "nf4", 4) == ROWS * 64 * 4


def test_the_memory_estimate_counts_the_rollouts_dense_copies_on_the_cpu_and_the_probes_blocks():
    bf16_products = "hardware.cpu_float32_gemm=false"  # the same figures on every CPU
    # CUDA's side without the attention scores strict determinism adds there (test_preflight checks those)
    fused = "hardware.deterministic=false"
    cfg = to_config(compose_config([*QWEN3, "hardware.rollout_cpu_fp16_lm_head=false", bf16_products, fused]))
    estimate, student = memory_estimate.estimate_peak_bytes, memory_estimate.architecture("model", cfg.model)
    # The CPU rollout decodes with bf16 copies of the 4-bit weights (hardware.rollout_dequantize_4bit_once) ...
    assert estimate(cfg, "cpu") - estimate(cfg, "cuda") == memory_estimate.linear_weights(student) * 2
    # ... float32 ones where every role multiplies in float32 (hardware.cpu_float32_gemm).
    float32 = to_config(
        compose_config([*QWEN3, "hardware.rollout_cpu_fp16_lm_head=false", "hardware.cpu_float32_gemm=true", fused])
    )
    assert estimate(float32, "cpu") - estimate(float32, "cuda") == memory_estimate.linear_weights(student) * 4
    # ... and, where it reads one, with a float16 copy of the float32 lm_head (hardware.rollout_cpu_fp16_lm_head).
    half_head = to_config(compose_config([*QWEN3, "hardware.rollout_cpu_fp16_lm_head=true", bf16_products, fused]))
    assert estimate(half_head, "cpu") - estimate(cfg, "cpu") == ROWS * 512 * 2  # fbgemm pads its 64-wide rows to 512
    assert estimate(half_head, "cuda") == estimate(cfg, "cuda")
    heldout = ["data.val_files=data/toy_prompts_heldout.parquet", "eval.every=2", f"eval.exact_kl_max_vocab={ROWS}"]
    probed = to_config(compose_config([*QWEN3, *heldout, fused]))
    # Its exact KL holds four (rows, R, V) float32 blocks: two models' log-probs, exp, product.
    blocks = 4 * probed.hardware.update_chunk * probed.recipe.response_limit * ROWS * 4
    assert estimate(probed, "cuda") - estimate(cfg, "cuda") == blocks


def test_the_memory_estimate_keeps_every_layers_activations_without_gradient_checkpointing():
    checkpointed = to_config(compose_config([*QWEN3, "model.gradient_checkpointing=true"]))
    kept = to_config(compose_config([*QWEN3, "model.gradient_checkpointing=false"]))
    s, tokens = memory_estimate.architecture("model", kept.model), kept.recipe.prompt_limit + kept.recipe.response_limit
    # 16 float32 hidden widths per position and layer; checkpointed: one layer's, plus every layer's input.
    per_layer = kept.hardware.update_chunk * tokens * 16 * s["hidden"] * 4
    inputs = kept.hardware.update_chunk * tokens * s["layers"] * s["hidden"] * 4
    difference = memory_estimate.estimate_peak_bytes(kept) - memory_estimate.estimate_peak_bytes(checkpointed)
    assert s["layers"] > 1 and difference == (s["layers"] - 1) * per_layer - inputs


@pytest.mark.parametrize("float32_gemm", ["true", "false"])
def test_a_run_computes_the_same_bits_with_torchs_nan_fill_of_new_tensors(tmp_path, monkeypatch, float32_gemm):
    # hardware.deterministic leaves torch's NaN fill of new tensors off (utils/device.py): safe only
    # while no op reads memory nothing wrote, which the fill would turn into NaN here. Rollout (both
    # kinds of dense copies), teacher, actor and the held-out probe, bf16 over NF4.
    monkeypatch.setattr(torch.utils.deterministic, "fill_uninitialized_memory", False)  # restored after
    monkeypatch.delenv(device_module.FILL_UNINITIALIZED_ENV, raising=False)  # the first run without the fill
    heldout = ["data.val_files=data/toy_prompts_heldout.parquet", "eval.every=1", f"eval.exact_kl_max_vocab={ROWS}"]
    overrides = [*QWEN3, *heldout, "recipe.optimizer_updates=1", f"hardware.cpu_float32_gemm={float32_gemm}"]
    without = run(compose_config(overrides), tmp_path / "without")
    monkeypatch.setenv(device_module.FILL_UNINITIALIZED_ENV, "1")
    filled = run(compose_config(overrides), tmp_path / "filled")
    assert torch.utils.deterministic.fill_uninitialized_memory is True  # the second run filled
    assert filled["artifacts"]["trajectory_sha256"] == without["artifacts"]["trajectory_sha256"]
    assert filled["distillation_progress"] == without["distillation_progress"]
    assert len(filled["distillation_progress"]["exact_reverse_kl"]) == 2  # updates 0 and 1
    adapter = "peft_adapter/adapter_model.safetensors"
    assert (tmp_path / "filled" / adapter).read_bytes() == (tmp_path / "without" / adapter).read_bytes()


@pytest.mark.slow
def test_the_recipe_on_qwen3s_layout_resumes_exactly_in_a_fresh_process(tmp_path):
    # NF4 with bf16 compute: stopped after update 1, resumed in a fresh process, byte-equal to the run
    # that was not stopped (the toy recipe checks the same with its own resume check, tests/e2e/test_cli.py).
    overrides = [
        "+recipe=opd_k1",
        "model=toy_qwen3",
        "teacher=toy_qwen3",
        "recipe.optimizer_updates=2",
        "recipe.interrupt_after_updates=null",
        "recipe.response_limit=6",
        "trainer.progress_bar=false",
    ]
    run(compose_config(overrides), tmp_path / "reference")
    run(compose_config([*overrides, "trainer.stop_after_updates=1"]), tmp_path / "stopped")
    resumed = main(*overrides, f"trainer.resume_from={tmp_path / 'stopped'}", f"hydra.run.dir={tmp_path / 'resumed'}")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    verdicts, difference = first_difference(tmp_path / "reference", tmp_path / "resumed")
    assert difference is None and verdicts["adapter_and_optimizer_byte_identical"], difference
    worst_allowed, _ = precision.log_prob_tolerance(torch.bfloat16)
    for line in (tmp_path / "resumed" / "metrics.jsonl").read_text().splitlines():
        assert json.loads(line)["training/rollout_probs_diff_max"] <= worst_allowed
    assert toy.QWEN3_VOCAB_ROWS == ROWS


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_sampling_equals_scoring_within_the_bf16_tolerance_and_the_doctor_passes(tmp_path):
    cfg = compose_config([("hardware=auto" if o == "hardware=cpu" else o) for o in QWEN3])
    trainer = OPDTrainer(to_config(cfg), resolved_config(cfg), tmp_path)
    trainer.setup()
    assert trainer.device.type == "cuda"
    batch = trainer.teacher.compute_teacher_log_prob(rollout(trainer), 4)
    worst_allowed, mean_allowed = precision.log_prob_tolerance(torch.bfloat16)
    diff = (batch.rollout_log_probs - trainer.actor.compute_log_prob(batch, rows_per_forward=4)) * batch.response_mask
    assert (
        float(diff.abs().max()) <= worst_allowed and abs(float(diff.sum() / batch.response_mask.sum())) <= mean_allowed
    )
    source = models.source_of(trainer.cfg.model, trainer.run_dir / "toy_models" / "student")
    for check in (model_checks.check_self_test(trainer), model_checks.check_nf4_gradients(trainer, source)):
        assert check.status == "PASS", str(check)
