"""Models: loading (NF4, LoRA, tokenizers and their checks), adapters (teacher modes), the toy
models, precision (tolerances per compute dtype), cpu_gemm (half-precision products on the CPU)."""
