"""How long the matrix products of one decode step take on this CPU, and nothing else
(docs/bench.md, "the rollout misses its target"): the floor under miniverl's decode loop when it
computes the products every role computes (dense bf16 copies of the 4-bit weights, the
`prepare_model_for_kbit_training` float32 lm_head).

    python scripts/decode_products_floor.py ~/.cache/miniverl/real/smollm2-135m-instruct-every2

Random weights of the model's shapes (config.json); 4 rows, as the bench's rollout. Per step: every
layer's seven products (or q/k/v and gate/up fused into one each: the same values on the CPUs
measured, fewer calls), then the lm_head over the whole vocabulary. The weights of one step do not
fit in the cache, so each step reads them from memory, as the decode loop does.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROWS = 4


def timed_ms(fn, repeats: int = 30) -> float:
    for _ in range(5):
        fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats * 1e3


def main(model_dir: str) -> None:
    config = json.loads((Path(model_dir).expanduser() / "config.json").read_text())
    hidden, inner, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    q_out, kv_out = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    generator = torch.Generator().manual_seed(0)

    def weight(out: int, inp: int) -> torch.Tensor:
        return (torch.randn(out, inp, generator=generator) * 0.05).bfloat16()

    shapes = {"q": (q_out, hidden), "k": (kv_out, hidden), "v": (kv_out, hidden), "o": (hidden, q_out),
              "gate": (inner, hidden), "up": (inner, hidden), "down": (hidden, inner)}  # fmt: skip
    stack = [{name: weight(*shape) for name, shape in shapes.items()} for _ in range(layers)]
    for w in stack:
        w["qkv"], w["gate_up"] = torch.cat([w["q"], w["k"], w["v"]]), torch.cat([w["gate"], w["up"]])
    head = weight(config["vocab_size"], hidden).float()  # (V, H) float32, as after prepare_model_for_kbit_training
    x, x_inner, x_head = (torch.randn(ROWS, n, generator=generator).bfloat16() for n in (hidden, inner, hidden))
    x_attn = torch.randn(ROWS, q_out, generator=generator).bfloat16()
    x_head = x_head.float()

    def separate():
        for w in stack:
            for name in ("q", "k", "v", "gate", "up"):
                F.linear(x, w[name])
            F.linear(x_attn, w["o"])
            F.linear(x_inner, w["down"])

    def fused():
        for w in stack:
            F.linear(x, w["qkv"]), F.linear(x_attn, w["o"]), F.linear(x, w["gate_up"]), F.linear(x_inner, w["down"])

    def lm_head():
        F.linear(x_head, head)

    layer_bytes = sum(t.numel() * t.element_size() for w in stack for n, t in w.items() if n in shapes)
    print(f"{model_dir}: {layers} layers, {layer_bytes / 2**20:.1f} MiB of bf16 layer weights, "
          f"lm_head {head.numel() * 4 / 2**20:.1f} MiB float32; {ROWS} rows; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")  # fmt: skip
    rows = {
        "layers, seven products each": separate,
        "layers, q/k/v and gate/up fused": fused,
        "lm_head (float32)": lm_head,
        "one step, seven products each": lambda: (separate(), lm_head()),
        "one step, fused": lambda: (fused(), lm_head()),
    }
    for name, fn in rows.items():
        print(f"  {name:34s} {timed_ms(fn):7.2f} ms")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python scripts/decode_products_floor.py MODEL_DIR (a folder with config.json)")
    main(sys.argv[1])
