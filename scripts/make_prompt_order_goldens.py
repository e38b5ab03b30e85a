"""Golden prompt orders: the batches of dataset rows verl's train dataloader yields, pass after pass,
computed by verl's own sampler code.

    PYTHONPATH=<torchdata> python scripts/make_prompt_order_goldens.py [VERL_PACKAGE_DIR] [OUT.json]
    # default: the verl installed here; OUT tests/data/verl-<version>-prompt-order.json

Needs torchdata (verl's dataloader package; `pip install --no-deps --target /tmp/td torchdata` is
enough) and verl's source, not verl importable: its `create_rl_sampler` (0.8.0: trainer/main_ppo.py,
0.9.x: trainer/ppo/utils.py) is read from the file and run as it is, because importing those
modules pulls ray. Around it, what verl's trainer does with the sampler (ray_trainer.py, both
releases): `StatefulDataLoader(dataset, batch_size=data.train_batch_size, drop_last=True,
sampler=create_rl_sampler(config.data, dataset))`, iterated once per epoch to its end.
Nothing of miniverl is imported: tests/trainer/test_plan.py checks miniverl's plan against
the file.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import sys
from pathlib import Path

from omegaconf import OmegaConf
from torchdata.stateful_dataloader import StatefulDataLoader

# (rows, train_batch_size, shuffle, seed, epochs): a pass that divides into batches and passes that
# leave a partial batch (dropped), shuffled with a seed, with verl's default seed (null), in file order.
CASES = (
    (10, 4, True, 1, 3),
    (8, 4, True, 7, 3),
    (64, 8, True, 1, 2),
    (6, 2, True, None, 2),
    (10, 4, False, 1, 3),
    (5, 5, True, 3, 3),
)


def create_rl_sampler(verl_dir: Path):
    """verl's own create_rl_sampler, compiled from its source file."""
    for relative in ("trainer/ppo/utils.py", "trainer/main_ppo.py"):
        path = verl_dir / relative
        if not path.is_file():
            continue
        tree = ast.parse(path.read_text())
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and node.name == "create_rl_sampler":
                namespace: dict = {}
                exec(compile(ast.Module(body=[node], type_ignores=[]), str(path), "exec"), namespace)
                return namespace["create_rl_sampler"], f"{relative}:{node.lineno}"
    raise SystemExit(f"no create_rl_sampler in {verl_dir}")


def verl_batches(sampler_of, rows: int, batch: int, shuffle: bool, seed: int | None, epochs: int) -> list:
    data = OmegaConf.create({"shuffle": shuffle, "seed": seed, "train_batch_size": batch})
    dataset = list(range(rows))
    loader = StatefulDataLoader(
        dataset, batch_size=data.train_batch_size, drop_last=True, collate_fn=list, sampler=sampler_of(data, dataset)
    )
    return [[list(b) for b in loader] for _ in range(epochs)]  # each epoch: the trainer's `for batch in dataloader`


def main() -> None:
    installed = importlib.util.find_spec("verl")  # found, not imported (its __init__ pulls ray)
    verl_dir = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(installed.submodule_search_locations[0])
    version = (verl_dir / "version" / "version").read_text().strip()
    out = Path(sys.argv[2]) if len(sys.argv) > 2 else Path(__file__).resolve().parents[1] / "tests" / "data"
    out = out / f"verl-{version}-prompt-order.json" if out.is_dir() else out
    sampler_of, where = create_rl_sampler(verl_dir)
    fields = ("rows", "train_batch_size", "shuffle", "seed")
    cases = [{**dict(zip(fields, case)), "epochs": verl_batches(sampler_of, *case)} for case in CASES]
    golden = {
        "source": f"verl v{version}: {where} create_rl_sampler, in StatefulDataLoader(drop_last=True) as "
        "ray_trainer.py builds it",
        "verl_version": version,
        "made_by": "scripts/make_prompt_order_goldens.py",
        "cases": cases,
    }
    lines = ",\n  ".join(json.dumps(case) for case in golden.pop("cases"))  # a case a line
    out.write_text(json.dumps(golden, indent=1)[:-2] + f',\n "cases": [\n  {lines}\n ]\n}}\n')
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
