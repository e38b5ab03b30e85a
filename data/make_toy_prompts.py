"""Write the 64 toy prompts (verl's parquet format) that toy runs train on, and 16 held-out ones.

    python data/make_toy_prompts.py [OUT.parquet [HELDOUT.parquet]]

Deterministic: the same file on every machine with the same pyarrow. Rows follow verl's data
preprocessing (e.g. examples/data_preprocess/gsm8k.py): `data_source`, `prompt` (a list of chat
messages), `ability`, `reward_model` ({style, ground_truth}) and `extra_info` ({split, index}).
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

N_PROMPTS = 64
SEED = 20260829
N_HELDOUT = 16
HELDOUT_SEED = 20261129
TEMPLATES = (
    ("What is {a} + {b}?", lambda a, b: a + b),
    ("What is {a} - {b}?", lambda a, b: a - b),
    ("Compute {a} times {b}.", lambda a, b: a * b),
    ("Add {a} and {b}.", lambda a, b: a + b),
)


def make_rows(n: int = N_PROMPTS, seed: int = SEED, split: str = "train") -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for index in range(n):
        template, answer = TEMPLATES[index % len(TEMPLATES)]
        a, b = rng.randint(2, 99), rng.randint(2, 99)
        rows.append(
            {
                "data_source": "miniverl/toy_arithmetic",
                "prompt": [{"role": "user", "content": template.format(a=a, b=b) + " Answer briefly."}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": str(answer(a, b))},
                "extra_info": {"split": split, "index": index},
            }
        )
    return rows


def write(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)


if __name__ == "__main__":
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).with_name("toy_prompts.parquet")
    heldout = Path(sys.argv[2]) if len(sys.argv) > 2 else Path(__file__).with_name("toy_prompts_heldout.parquet")
    write(out, make_rows())
    write(heldout, make_rows(N_HELDOUT, HELDOUT_SEED, split="test"))
    print(f"wrote {N_PROMPTS} prompts to {out} and {N_HELDOUT} held-out prompts to {heldout}")
