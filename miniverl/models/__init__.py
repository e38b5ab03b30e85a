"""Models: loading (NF4, LoRA, tokenizers), tokenizers (whether a teacher can score the student's
ids), adapters (teacher modes), the toy models, precision (tolerances per compute dtype), cpu_gemm
(half-precision products on the CPU)."""
