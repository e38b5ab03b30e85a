"""Write the 64 toy prompts (verl's parquet format) that toy runs train on, and 16 held-out ones;
the digit-sum task of the task-reward toy recipe (64 + 16 prompts whose answer is one digit); and
the two-source mix of the two-teacher recipe (arithmetic and echo rows, alternating: 64 + 16).

    python data/make_toy_prompts.py [OUT.parquet [HELDOUT.parquet]]   # digit sums: beside them

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
DIGIT_SEED, DIGIT_HELDOUT_SEED = 20261201, 20261202
MIXED_SEED, MIXED_HELDOUT_SEED = 20261203, 20261204
WORDS = ("cat", "dog", "sun", "map", "red", "owl", "ink", "bee", "fig", "jam", "kit", "log")
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


def make_digit_rows(n: int = N_PROMPTS, seed: int = DIGIT_SEED, split: str = "train") -> list[dict]:
    """`What is a + b?` with a + b <= 9: an answer a 2-layer toy can sample by chance, so that the
    task reward (the last number of the response equals the sum) is earned from the first update."""
    rng = random.Random(seed)
    rows = []
    for index in range(n):
        a = rng.randint(0, 9)
        b = rng.randint(0, 9 - a)
        rows.append(
            {
                "data_source": "miniverl/toy_arithmetic",
                "prompt": [{"role": "user", "content": f"What is {a} + {b}? Answer with one digit."}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": str(a + b)},
                "extra_info": {"split": split, "index": index},
            }
        )
    return rows


def make_mixed_rows(n: int = N_PROMPTS, seed: int = MIXED_SEED, split: str = "train") -> list[dict]:
    """Two data sources in turn, one teacher each in the two-teacher recipe: the arithmetic prompts
    (data_source miniverl/toy_arithmetic) and `Repeat: <w> <w>` (data_source miniverl/toy_echo,
    the answer is the two words)."""
    arithmetic = make_rows(n // 2, seed, split)
    rng = random.Random(seed + 1)
    rows = []
    for index in range(n):
        if index % 2 == 0:
            row = arithmetic[index // 2]
        else:
            words = f"{rng.choice(WORDS)} {rng.choice(WORDS)}"
            row = {
                "data_source": "miniverl/toy_echo",
                "prompt": [{"role": "user", "content": f"Repeat: {words}"}],
                "ability": "copy",
                "reward_model": {"style": "rule", "ground_truth": words},
            }
        rows.append({**row, "extra_info": {"split": split, "index": index}})
    return rows


def write(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)


if __name__ == "__main__":
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).with_name("toy_prompts.parquet")
    heldout = Path(sys.argv[2]) if len(sys.argv) > 2 else Path(__file__).with_name("toy_prompts_heldout.parquet")
    write(out, make_rows())
    write(heldout, make_rows(N_HELDOUT, HELDOUT_SEED, split="test"))
    digits, digits_heldout = out.with_name("toy_digit_sums.parquet"), out.with_name("toy_digit_sums_heldout.parquet")
    write(digits, make_digit_rows())
    write(digits_heldout, make_digit_rows(N_HELDOUT, DIGIT_HELDOUT_SEED, split="test"))
    mixed, mixed_heldout = out.with_name("toy_mixed.parquet"), out.with_name("toy_mixed_heldout.parquet")
    write(mixed, make_mixed_rows())
    write(mixed_heldout, make_mixed_rows(N_HELDOUT, MIXED_HELDOUT_SEED, split="test"))
    print(f"wrote {N_PROMPTS} prompts to {out} and {N_HELDOUT} held-out prompts to {heldout}")
    print(f"wrote {N_PROMPTS} digit sums to {digits} and {N_HELDOUT} held-out ones to {digits_heldout}")
    print(f"wrote {N_PROMPTS} mixed rows to {mixed} and {N_HELDOUT} held-out ones to {mixed_heldout}")
