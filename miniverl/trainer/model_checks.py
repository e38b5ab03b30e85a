"""The doctor's checks that load the models (miniverl/doctor.py runs them after the cheap ones of
preflight.py pass): the self-test (the student's own weights as its teacher score a k1 of ~0) and
nf4-gradients (LoRA gradients through the NF4 base against a dense twin of the dequantized weights)."""

from __future__ import annotations

import types

import torch

from miniverl.models import cpu_gemm, precision
from miniverl.models import loading as models
from miniverl.trainer.preflight import Check


def check_self_test(trainer) -> Check:
    """The student's own weights as teacher: k1 = log pi - log pi must vanish at every position,
    up to the rounding of the student's compute precision (miniverl/models/precision.py)."""
    from miniverl.workers.teacher import TeacherWorker

    update = trainer.plan.updates[0]
    prompts = trainer.prompts.token_ids_of(update.sample_rows)
    batch = trainer.rollout.generate_sequences(
        prompts,
        list(update.sample_rows),
        list(update.sample_seeds),
        response_limit=trainer.cfg.recipe.response_limit,
        physical_batches=list(update.rollout_physical_batches),
    )
    own = TeacherWorker(
        trainer.student.get_base_model(),
        logprob_chunk=trainer.cfg.hardware.logprob_chunk,
        topk=None,
        tokenizer_vocab=len(trainer.tokenizer),
        float32_gemm=trainer.rollout.float32_gemm,  # every role's alike (models/cpu_gemm.py)
    )
    batch = own.compute_teacher_log_prob(batch, trainer.cfg.hardware.update_chunk)
    k1 = batch.rollout_log_probs - batch.teacher_logprobs  # (B, T)
    status, line = precision.agreement(k1, batch.response_mask, precision.least_precise_dtype(trainer.student))
    return Check(status, "self-test", line)


def dequantized_twin(nf4_model, source: models.Source, block, float32_gemm: bool):
    """A dense copy of an NF4 model that computes what its NF4 layers should: each linear layer
    holds exactly the dequantized weight and multiplies in the layer's compute dtype (bitsandbytes
    casts the input to it and the output back; with `float32_gemm` as cpu_gemm does), every other
    weight in the NF4 model's dtype. The comparison is like with like: only the NF4 path itself can
    make the two differ."""
    import bitsandbytes as bnb
    from transformers import AutoModelForCausalLM

    dense = AutoModelForCausalLM.from_pretrained(
        source.path, revision=source.revision, dtype=torch.float32, trust_remote_code=block.trust_remote_code
    )
    quantized = {n.replace(".base_layer", ""): m for n, m in nf4_model.named_modules()}
    with torch.no_grad():
        for name, module in list(dense.named_modules()):
            src = quantized.get(name)
            if isinstance(src, bnb.nn.Linear4bit):
                # A linear layer as bitsandbytes made it (GPT-2's Conv1D, which holds its weight transposed,
                # becomes one too), so that LoRA adapts the two models' layers alike.
                weight = bnb.functional.dequantize_4bit(src.weight.data, src.weight.quant_state).float()
                linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=module.bias is not None)
                linear.weight.copy_(weight)
                if module.bias is not None:
                    linear.bias.copy_(module.bias)
                linear.forward = types.MethodType(_linear_in(src.compute_dtype or torch.float32, float32_gemm), linear)
                parent, _, child = name.rpartition(".")
                setattr(dense.get_submodule(parent) if parent else dense, child, linear)
        unquantized = {
            n.replace(".base_layer", ""): p
            for n, p in nf4_model.named_parameters()
            if p.dtype.is_floating_point and "lora_" not in n
        }
        for name, param in dense.named_parameters():
            if name in unquantized and not isinstance(quantized.get(name.rsplit(".", 1)[0]), bnb.nn.Linear4bit):
                param.data = param.data.to(unquantized[name].dtype)
    # A family may branch on the attribute's presence: Jamba's Mamba mixer calls dt_proj (and its LoRA) when the
    # config has it, and multiplies by dt_proj.weight otherwise, which would make the twin another computation.
    if hasattr(nf4_model.config, "_is_quantized"):
        dense.config._is_quantized = nf4_model.config._is_quantized
    return dense


def _linear_in(compute: torch.dtype, float32_gemm: bool):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(compute)
        return cpu_gemm.linear(x.to(compute), self.weight.to(compute), bias, float32_gemm=float32_gemm).to(x.dtype)

    return forward


def check_nf4_gradients(trainer, source: models.Source) -> Check:
    block = trainer.cfg.model
    if block.quantization != "nf4":
        return Check("PASS", "nf4-gradients", "the student is not quantized")
    if block.adapter:
        return Check("PASS", "nf4-gradients", "skipped: the student starts from an adapter")
    twin = dequantized_twin(trainer.student.get_base_model(), source, block, trainer.rollout.float32_gemm)
    dense = models.wrap_student(twin, block, torch.device("cpu"), lora_seed=0)
    nf4 = trainer.student
    ids = torch.tensor([trainer.prompts.token_ids[0]], device=trainer.device)
    grads = []
    # By name: a shared_base student also holds its teacher's adapter, which the twin has not.
    trained = {name: p for name, p in nf4.named_parameters() if p.requires_grad}
    for model in (nf4, dense.to(trainer.device)):
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name in trained:
                    p.copy_(torch.full_like(p, 0.01) if "lora_B" in name else trained[name])
        model.train()
        model.zero_grad()
        # The products training uses, in the backward's recomputed forward too; one seed for both models'
        # dropout (OPT's config has 0.1), so that their masks are the same (the doctor trains nothing after).
        with cpu_gemm.float32_products(model, trainer.rollout.float32_gemm):
            torch.manual_seed(0)
            logits = model(input_ids=ids, use_cache=False).logits.float()
            # log_softmax + gather, not cross_entropy: CUDA's NLLLoss has no deterministic kernel.
            loss = -logits[0, :-1].log_softmax(-1).gather(-1, ids[0, 1:, None]).mean()
            loss.backward()
        # A vision-language model's vision tower is adapted too, and gets no gradient from text alone.
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad and p.grad is not None})
        model.zero_grad(set_to_none=True)
        model.eval()
    worst = max(
        float((grads[0][n] - grads[1][n]).abs().max() / grads[1][n].abs().max().clamp_min(1e-12)) for n in grads[1]
    )
    dtype = precision.least_precise_dtype(nf4)
    allowed = precision.GRADIENT_TOLERANCE
    line = (
        f"largest relative difference of the LoRA gradients: {worst:.1e} against the dequantized base in the "
        f"same {str(dtype).replace('torch.', '')} compute (allowed {allowed:g})"
    )
    return Check("PASS" if worst <= allowed else "FAIL", "nf4-gradients", line)
