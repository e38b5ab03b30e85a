"""Which product is faster on this CPU at a model's shapes: torch's native bf16 GEMM, or the float32
GEMM of the same bf16 operands rounded back to bf16 (`hardware.cpu_float32_gemm=true`,
miniverl/models/cpu_gemm.py). The run chooses by the CPU's instructions (native where it has AMX or
AVX512-BF16); this measures the choice where it is a matter of speed.

    python scripts/cpu_product_choice.py ~/.cache/miniverl/real/smollm2-135m-instruct-drop5 --held32
    ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 python scripts/cpu_product_choice.py PATH --held32   # as without AMX

Every linear layer of the model's decoder (its config.json: random bf16 weights of those shapes, one
per layer, so each pass reads them from memory as a real one does) multiplies, for each row count:
the forward x @ W^T (the float32 form converting W per call, as bitsandbytes' per-call layers do, and
with W held in float32, as the rollout's dense copies are) and the backward's grad @ W. Configurations
are interleaved and each time is the median of --repeats passes. The output layer is left out (the
student's is float32 either way, prepare_model_for_kbit_training; an NF4 teacher's bf16 lm_head takes
the chosen product too, and is not timed here)."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from miniverl.utils.device import cpu_bf16_instructions


def layer_shapes(config: dict) -> list[tuple[int, int]]:
    """(out, in) of one decoder layer's seven projections (Llama/Qwen layout)."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    kv = config.get("num_key_value_heads", heads) * head_dim
    q = heads * head_dim
    return [(q, hidden), (kv, hidden), (kv, hidden), (hidden, q), (inter, hidden), (inter, hidden), (hidden, inter)]


def passes(weights: list[torch.Tensor], held32: list[torch.Tensor], rows: int) -> dict:
    """name -> a function running one pass of every layer's product at `rows` rows."""
    xs = {w.shape[1]: torch.randn(rows, w.shape[1]).to(torch.bfloat16) for w in weights}
    gs = {w.shape[0]: torch.randn(rows, w.shape[0]).to(torch.bfloat16) for w in weights}
    linear = torch.nn.functional.linear
    return {
        "forward native bf16": lambda: [linear(xs[w.shape[1]], w) for w in weights],
        "forward float32, W converted per call": lambda: [
            linear(xs[w.shape[1]].float(), w.float()).to(torch.bfloat16) for w in weights
        ],
        "forward float32, W held in float32": lambda: [
            linear(xs[w.shape[1]].float(), w).to(torch.bfloat16) for w in held32
        ],
        "backward grad @ W native bf16": lambda: [gs[w.shape[0]] @ w for w in weights],
        "backward grad @ W float32": lambda: [(gs[w.shape[0]].float() @ w.float()).to(torch.bfloat16) for w in weights],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path, help="a Hugging Face folder (its config.json is read)")
    parser.add_argument("--rows", type=int, nargs="+", default=[4, 360], help="rows per product")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--held32", action="store_true", help="also the forward with W held in float32")
    args = parser.parse_args()
    config = json.loads((args.model / "config.json").read_text())
    torch.manual_seed(0)
    shapes = layer_shapes(config) * config["num_hidden_layers"]
    weights = [(torch.randn(o, i) * 0.02).to(torch.bfloat16) for o, i in shapes]
    held32 = [w.float() for w in weights] if args.held32 else []
    print(
        f"CPU bf16 instructions: {cpu_bf16_instructions()}; {len(weights)} products a pass; threads "
        f"{torch.get_num_threads()}; median of {args.repeats} passes, interleaved (ms)"
    )
    for rows in args.rows:
        methods = passes(weights, held32, rows)
        if not args.held32:
            methods.pop("forward float32, W held in float32")
        times = {name: [] for name in methods}
        for run in methods.values():  # warm-up
            run()
        for _ in range(args.repeats):
            for name, run in methods.items():
                start = time.perf_counter()
                run()
                times[name].append(time.perf_counter() - start)
        for name, samples in times.items():
            print(f"rows {rows:4d}  {name:40s} {1e3 * statistics.median(samples):9.2f}")


if __name__ == "__main__":
    main()
