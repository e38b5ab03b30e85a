"""The table of which distillation objective distils best on one device: the same recipe, prompts,
seed and number of updates for each objective of docs/objectives.md, run one after the other.

    python scripts/objectives_table.py                       # the real fixture (python -m miniverl.real_models)
    python scripts/objectives_table.py --recipe opd_k1_toy_distill --updates 8 --out /tmp/objectives_toy
    python scripts/objectives_table.py --only "k1;k3" --seeds 3 --set data.train_files=data/toy_digit_sums.parquet

Each objective is `python -m miniverl.main +recipe=<recipe> <its overrides>` in a fresh process (the
recipe's own settings otherwise: its clamp, learning rate, held-out files), with the resume check off
and the held-out exact reverse KL measured every `--every` updates, once per seed (`--seeds N` seeds from
`--seed`, each seed one LoRA start and one rollout stream, shared by every objective). Written to OUT.md
(the table: the median over the seeds of the held-out KL at each measured update, each seed's KL at the
last update, the median wall time per update, the largest peak RSS), OUT.png (the median curves on one
plot), OUT.json (every run's numbers); each run's folder is RUNS/<i>-seed<s> (default
outputs/objectives/<OUT's name>). Run it alone on the machine: wall times are only comparable within one
quiet run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

# name -> miniverl overrides on top of the recipe (docs/objectives.md says what each computes)
OBJECTIVES: dict[str, list[str]] = {
    "k1": ["estimator=k1"],
    "k3": ["estimator=k3"],
    "k1, kl_discount_factor 0.9": ["estimator=k1", "estimator.kl_discount_factor=0.9"],
    "k1, kl_discount_factor 0.9, batch-mean baseline": [
        "estimator=k1",
        "estimator.kl_discount_factor=0.9",
        "estimator.advantage_baseline=batch_mean",
    ],
    "k1, entropy selection 0.5": [
        "estimator=k1",
        "estimator.token_selection.by=entropy",
        "estimator.token_selection.keep=0.5",
    ],
    "forward top-k": ["estimator=forward_kl_topk"],
    "forward top-k + tail": ["estimator=forward_kl_topk_tail"],
    "reverse top-k": ["estimator=reverse_kl_topk"],
}


def run_one(name: str, overrides: list[str], seed: int, args, folder: Path) -> dict:
    if not any(o.startswith("estimator.advantage_baseline=") for o in overrides):
        # The real recipe's k1 has a baseline since profile v3; the table's rows are without one
        # unless they say so (and the estimators without an advantage refuse one).
        overrides = [*overrides, "estimator.advantage_baseline=none"]
    command = [
        sys.executable,
        "-m",
        "miniverl.main",
        f"+recipe={args.recipe}",
        *overrides,
        f"recipe.optimizer_updates={args.updates}",
        "recipe.interrupt_after_updates=null",
        f"eval.every={args.every}",
        f"trainer.seed={seed}",
        "trainer.progress_bar=false",
        *args.set,
        f"hydra.run.dir={folder}",
    ]
    started = time.time()
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["?"]
        print(f"{name}: failed ({tail[0]})", file=sys.stderr)
        return {"objective": name, "seed": seed, "overrides": overrides, "status": "failed", "error": tail[0]}
    report = json.loads((folder / "report.json").read_text())
    steps = [json.loads(line)["timing_s/step"] for line in (folder / "metrics.jsonl").read_text().splitlines()]
    progress = report["distillation_progress"]["exact_reverse_kl"]
    return {
        "objective": name,
        "seed": seed,
        "overrides": overrides,
        "status": report["status"],
        "exact_reverse_kl": {p["update"]: p["value"] for p in progress},
        "seconds_per_update_median": statistics.median(steps),
        "peak_rss_gib": report["measurements"]["peak_rss_gib"],
        "wall_seconds": round(time.time() - started, 1),
    }


def by_objective(rows: list[dict]) -> dict[str, list[dict]]:
    """The measured runs of each objective, in the order the objectives first appear."""
    grouped: dict[str, list[dict]] = {}
    for r in rows:
        grouped.setdefault(r["objective"], [])
        if r["status"] == "measured":
            grouped[r["objective"]].append(r)
    return grouped


def write(rows: list[dict], args, out: Path) -> None:
    grouped = by_objective(rows)
    updates = sorted({int(u) for r in rows if r["status"] == "measured" for u in r["exact_reverse_kl"]})
    seeds = sorted({r["seed"] for r in rows})
    head = ["objective", *[f"KL @ {u}" for u in updates], f"KL @ last, seed {' / '.join(map(str, seeds))}"]
    head += ["s / update", "peak RSS GiB"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    medians = {}
    for name, runs in grouped.items():
        failed = [r for r in rows if r["objective"] == name and r["status"] != "measured"]
        if not runs:
            lines.append(f"| {name} | failed: {failed[0].get('error', failed[0]['status'])} |")
            continue
        # a run that stopped early lacks its last measurements: the median is over the runs that have them
        medians[name] = {
            u: statistics.median(v) if (v := [r["exact_reverse_kl"][u] for r in runs if u in r["exact_reverse_kl"]])
            else float("nan")
            for u in updates
        }  # fmt: skip
        by_seed = {r["seed"]: f"{r['exact_reverse_kl'].get(updates[-1], float('nan')):.3f}" for r in runs}
        by_seed.update({r["seed"]: "failed" for r in failed})
        last = " / ".join(by_seed[seed] for seed in sorted(by_seed))
        step = statistics.median(r["seconds_per_update_median"] for r in runs)
        rss = max(r["peak_rss_gib"] for r in runs)
        kl = [f"{medians[name][u]:.3f}" for u in updates]
        lines.append(f"| {name} | " + " | ".join(kl) + f" | {last} | {step:.2f} | {rss:.2f} |")
    command = " ".join(["python scripts/objectives_table.py", *sys.argv[1:]])
    what = f"seed {seeds[0]}" if len(seeds) == 1 else f"the median over seeds {', '.join(map(str, seeds))}"
    out.with_suffix(".md").write_text(
        f"Held-out exact reverse KL(student || teacher) by update, recipe `{args.recipe}`, {what}, "
        f"{args.updates} updates (`{command}`):\n\n" + "\n".join(lines) + "\n"
    )
    out.with_suffix(".json").write_text(json.dumps({"command": command, "rows": rows}, indent=2) + "\n")
    fig, ax = plt.subplots(figsize=(10, 4.5))
    for name, curve in medians.items():
        ax.plot(list(curve), list(curve.values()), marker="o", label=name)
    ax.set_xlabel("optimizer update")
    ax.set_ylabel("held-out exact reverse KL (nats / token)")
    ax.set_title(f"{args.recipe}, {what}")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0))  # beside the curves, never over them
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default="opd_k1_real_cpu")
    parser.add_argument("--updates", type=int, default=16)
    parser.add_argument("--every", type=int, default=4, help="held-out KL every this many updates")
    parser.add_argument("--seed", type=int, default=1, help="the first seed")
    parser.add_argument("--seeds", type=int, default=1, help="seeds SEED..SEED+N-1 for every objective")
    parser.add_argument("--only", help="objective names separated by ; (default: all)")
    parser.add_argument("--set", action="append", default=[], help="one more override for every run")
    parser.add_argument("--out", default="docs/objectives_table", help="OUT.md / OUT.png / OUT.json")
    parser.add_argument("--runs", help="the runs' folders (default: outputs/objectives/<OUT's name>)")
    args = parser.parse_args()
    chosen = OBJECTIVES if args.only is None else {k: OBJECTIVES.get(k) for k in args.only.split(";")}
    out = Path(args.out)
    runs = Path(args.runs or f"outputs/objectives/{out.name}")
    if runs.exists():
        print(f"{runs} exists: a previous table's runs; move it away or pass another --out", file=sys.stderr)
        return 2
    unknown = [name for name in chosen if name not in OBJECTIVES]
    if unknown or args.seeds < 1:
        print(f"unknown objective {unknown[0]!r}; choose from {'; '.join(OBJECTIVES)}" if unknown
              else f"--seeds {args.seeds}: give at least 1", file=sys.stderr)  # fmt: skip
        return 2
    rows = []
    for seed in range(args.seed, args.seed + args.seeds):
        for i, (name, overrides) in enumerate(chosen.items()):
            rows.append(run_one(name, overrides, seed, args, runs / f"{i}-seed{seed}"))
            print(json.dumps(rows[-1]), flush=True)
            write(rows, args, out)  # after every run: a crash loses nothing
    return 0 if all(r["status"] == "measured" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
