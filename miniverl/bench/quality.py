"""`python -m miniverl.bench --quality`: how much the student learns per update and per second,
miniverl next to TRL on the same models, prompts and settings.

    python -m miniverl.bench --quality --student PATH --teacher PATH [--train FILE --heldout FILE]
                             [--seeds N] [--first-seed K] [--updates N] [--out DIR]
                             [--objective both|k1|full]   # one pair only: half the time
                             [--override KEY=VALUE ...]   # miniverl's sides only: an ablation

Four sides, each trained from the same LoRA initialisation (miniverl's, for the seed) for the same
number of updates, with the settings of `+recipe=opd_k1_real_cpu` (LoRA, AdamW, grad clip,
prompts per update, response length, sampling):

    miniverl_k1    miniverl's recipe: k1 advantage less the update's mean k1, verl's vanilla PPO loss
    miniverl_full  miniverl with estimator=reverse_kl_full (the exact full-vocabulary reverse KL)
    trl_iwopd      TRL's experimental IWOPDTrainer, iw_opd_gamma=0: the sampled-token k1 policy gradient
    trl_distill    TRL's DistillationTrainer, beta=1: the exact full-vocabulary reverse KL

Every student, whoever trained it, is measured by miniverl's own held-out probe
(`ValidationProbe`: the same sampling streams, the same teacher, the exact reverse KL) before
training, half-way and at the end. TRL's LoRA weights are read at those updates and loaded into
miniverl's student for the probe, so the only thing that differs between the sides is training.

TRL runs as a user would run it: its own data order, bitsandbytes' CPU kernel choice as shipped,
and its own dtype for the LoRA weights (DistillationTrainer casts a quantized model's to bf16 and
steps them there, the other sides train them in float32; each side's `adapter_dtype` in
quality.json says which). One workaround: IWOPDTrainer 1.16 divides its loss by the number of label
tokens that transformers counts before generation, which is zero for a dataset of prompts only (NaN
weights after the first step); without that count it divides by the generated tokens, its own
fallback.

It writes quality.json (`ratios`: medians over the seeds), quality.md and quality.png to --out.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from miniverl import CHECKOUT
from miniverl.utils.dataset import locate
from miniverl.utils.errors import MiniverlError
from miniverl.utils.run_names import ADAPTER, METRICS


@dataclass(frozen=True)
class Side:
    computes: str  # what it trains with, in words (quality.json's `computes`)
    objective: str  # the pair it belongs to: "k1" or "full" (--objective)
    trl: bool = False  # trained by TRL (quality_trl.run_trl), else by miniverl's own run
    overrides: tuple[str, ...] = ()  # miniverl's sides: on top of the recipe's config


SIDES = {
    "miniverl_k1": Side(
        "miniverl +recipe=opd_k1_real_cpu: the k1 advantage less its batch mean, in verl's vanilla PPO loss", "k1"
    ),
    # The full-vocabulary loss has no advantage, so no baseline (the recipe's k1 has one, docs/learning.md).
    "miniverl_full": Side(
        "miniverl estimator=reverse_kl_full: the exact full-vocabulary reverse KL",
        "full",
        overrides=("estimator=reverse_kl_full", "estimator.advantage_baseline=none"),
    ),
    "trl_iwopd": Side(
        "TRL IWOPDTrainer (experimental), iw_opd_gamma=0: the sampled-token k1 policy gradient", "k1", trl=True
    ),
    "trl_distill": Side("TRL DistillationTrainer, beta=1: the exact full-vocabulary reverse KL", "full", trl=True),
}
PAIRS = {"trl_iwopd": "miniverl_k1", "trl_distill": "miniverl_full"}  # the same objective on both sides
RATIO_KEYS = (
    "heldout_kl_vs_trl_iwopd",
    "heldout_kl_vs_trl_distill",
    "seconds_per_update_vs_trl_iwopd",
    "seconds_per_update_vs_trl_distill",
    "seconds_per_update_vs_trl",
)
TARGETS = dict.fromkeys(RATIO_KEYS, "<= 1.0")
RECIPE = "opd_k1_real_cpu"


def compose(args, seed: int, *extra: str):
    """The recipe's config for one side and seed, on the user's models and prompts."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from miniverl.config import register_configs

    overrides = [
        f"+recipe={RECIPE}",
        f"model.model_id={Path(args.student).resolve()}",
        f"teacher.model_id={Path(args.teacher).resolve()}",
        f"data.train_files=[{locate(args.train).resolve()}]",  # the shipped prompts from any directory
        f"data.val_files=[{locate(args.heldout).resolve()}]",
        f"trainer.seed={seed}",
        f"recipe.optimizer_updates={args.updates}",
        f"eval.every={max(1, args.updates // 2)}",
        "eval.exact_kl_max_vocab=1000000",
        "recipe.interrupt_after_updates=null",
        "trainer.progress_bar=false",
        *(["hardware=auto"] if torch.cuda.is_available() else []),
        *extra,
    ]
    register_configs()
    with initialize_config_dir(config_dir=str(CHECKOUT / "conf"), version_base=None):
        return hydra_compose("config", overrides=overrides)


def compose_miniverl_side(args, seed: int, *extra: str):
    """A miniverl side's config: the recipe's, the side's own `extra`, then the user's --override
    (a mistaken override ends in one line, before anything trains)."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from miniverl.config import to_config
    from miniverl.utils.hydra_entry import hydra_error_line

    try:
        cfg = compose(args, seed, *extra, *args.override)
    except (HydraException, OmegaConfBaseException) as error:
        raise MiniverlError(f"--override {' '.join(args.override)}: {hydra_error_line(error)}") from error
    to_config(cfg)  # the schemas' checks (ranges, choices): one line each
    return cfg


def run_miniverl(cfg, run_dir: Path) -> dict:
    """One miniverl run in this process: its own probe's values and its seconds per update."""
    from safetensors.torch import load_file

    from miniverl.trainer.runner import run
    from miniverl.utils.device import determinism_restored

    with determinism_restored():  # the TRL sides after it run as a user runs TRL, not in miniverl's strict mode
        report = run(cfg, run_dir)
    history = [json.loads(line) for line in (run_dir / METRICS).read_text().splitlines()]
    kl = {p["update"]: p["value"] for p in report["distillation_progress"]["exact_reverse_kl"]}
    return {
        "heldout_kl": kl,
        "update_seconds": [m["timing_s/step"] for m in history],
        # The LoRA weights as the run saved them: in the dtype it trained them in.
        "adapter_dtype": dtype_names(load_file(run_dir / ADAPTER / "adapter_model.safetensors").values()),
    }


def dtype_names(tensors) -> str:
    """The dtype of `tensors` as torch names it ("float32", "bfloat16"; several joined by "+")."""
    return "+".join(sorted({str(t.dtype).removeprefix("torch.") for t in tensors}))


class Prober:
    """miniverl's held-out probe of one seed on a student that takes any side's LoRA weights."""

    def __init__(self, cfg):
        from miniverl.config import to_config
        from miniverl.models import loading as models
        from miniverl.trainer.plan import derive_seed
        from miniverl.trainer.validation import ValidationProbe
        from miniverl.utils.device import resolve_device
        from miniverl.utils.downshift import Downshift
        from miniverl.workers.factory import build_roles

        config = to_config(cfg)
        device = resolve_device(config.hardware)
        source = models.source_of(config.model, None)
        self.tokenizer = models.load_tokenizer("model", config.model, source)
        # The LoRA of the seed, as the miniverl sides start from it: TRL's sides start from it too.
        self.student = models.load_student(
            config.model,
            source,
            device,
            lora_seed=derive_seed(config.trainer.seed, "lora"),
            use_nf4_cache=config.hardware.nf4_cache,
        )
        self.initial = {k: v.clone() for k, v in self.lora_weights(self.student).items()}
        roles = build_roles(config, self.student, self.tokenizer, device, {}, {})
        self.teacher = roles.teacher
        self.probe = ValidationProbe.from_config(config, self.tokenizer, roles.rollout, roles.teacher, roles.actor)
        self.shift = Downshift.for_hardware(device, config.hardware)
        self.config, self.device = config, device

    @staticmethod
    def lora_weights(model) -> dict[str, torch.Tensor]:
        from peft import get_peft_model_state_dict

        return {k: v.detach().to("cpu", torch.float32, copy=True) for k, v in get_peft_model_state_dict(model).items()}

    def measure(self, weights: dict[str, torch.Tensor]) -> float:
        from peft import set_peft_model_state_dict

        loaded = set_peft_model_state_dict(self.student, weights)
        if loaded.unexpected_keys:
            unknown = loaded.unexpected_keys[:2]
            raise MiniverlError(f"bench --quality: the peer's adapter has weights miniverl's lacks: {unknown}")
        return self.probe.measure(self.shift)["exact_reverse_kl"]


def run(args, out: Path) -> dict:
    from miniverl.bench.quality_trl import run_trl, trl_missing
    from miniverl.bench.tables import machine_facts

    if (out / "runs").exists():  # its miniverl runs would refuse the folders of the previous ones
        raise MiniverlError(f"--out {out} already holds a quality run (runs/); choose another --out or remove it")
    started = time.perf_counter()
    seeds = list(range(args.first_seed, args.first_seed + args.seeds))
    chosen = [name for name, side in SIDES.items() if args.objective in ("both", side.objective)]
    sides: dict[str, dict[int, dict]] = {name: {} for name in chosen}
    missing = trl_missing()
    miniverl_sides = [name for name in chosen if not SIDES[name].trl]
    trl_sides = [name for name in chosen if SIDES[name].trl]
    configs = {  # every side and seed composed and checked before the first one trains
        (name, seed): compose_miniverl_side(args, seed, *SIDES[name].overrides)
        for seed in seeds
        for name in miniverl_sides
    }
    for seed in seeds:
        for name in miniverl_sides:
            print(f"--- {name}, seed {seed}", flush=True)
            sides[name][seed] = run_miniverl(configs[name, seed], out / "runs" / f"{name}_seed{seed}")
        if missing:
            continue
        prober = Prober(compose(args, seed))
        for name in trl_sides:
            print(f"--- {name}, seed {seed}", flush=True)
            trained = run_trl(name, prober, out / "runs" / f"{name}_seed{seed}")
            kl = {update: prober.measure(weights) for update, weights in trained.pop("weights").items()}
            sides[name][seed] = {"heldout_kl": kl, **trained}
        del prober
    result = summarise(args, seeds, sides, missing)
    result.update(machine=machine_facts(torch.device("cuda" if torch.cuda.is_available() else "cpu")))
    result["bench_seconds"] = round(time.perf_counter() - started, 1)
    (out / "quality.json").write_text(json.dumps(result, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    table = markdown(result)
    (out / "quality.md").write_text(table, encoding="utf-8")
    plot(result, out / "quality.png")
    print(table)
    print(f"wrote {out / 'quality.json'}, {out / 'quality.md'} and {out / 'quality.png'}")
    return result


def sign_test_p(lower: int, higher: int) -> float:
    """Two-sided sign test: the chance of a split at least this uneven between seeds on which
    miniverl ended lower and higher if either were equally likely (ties left out)."""
    n, fewer = lower + higher, min(lower, higher)
    return min(1.0, 2 * sum(math.comb(n, i) for i in range(fewer + 1)) / 2**n) if n else 1.0


def summarise(args, seeds: list[int], sides: dict, missing: str | None) -> dict:
    """Per side: the held-out KL at each probed update and seconds per update, each a median over the
    seeds (every seed's values kept); the ratios of the same-objective pairs."""
    summary = {}
    for name, runs in sides.items():
        if not runs:
            continue
        updates = sorted(next(iter(runs.values()))["heldout_kl"])
        summary[name] = {
            "computes": SIDES[name].computes,
            # What its LoRA trained in, over the seeds (each seed's value may already name several).
            "adapter_dtype": "+".join(sorted({d for s in runs for d in runs[s]["adapter_dtype"].split("+")})),
            "heldout_kl": {str(u): statistics.median(runs[s]["heldout_kl"][u] for s in runs) for u in updates},
            "seconds_per_update": statistics.median(statistics.median(runs[s]["update_seconds"]) for s in runs),
            "seeds": {str(s): runs[s] for s in runs},
        }
    ratios, null_reasons, per_seed = dict.fromkeys(RATIO_KEYS), {}, {}
    last = str(args.updates)
    for peer, ours in PAIRS.items():
        kind = peer.removeprefix("trl_")
        if peer not in summary or ours not in summary:
            asked = ours in sides  # --objective may leave a pair out
            reason = missing if asked else f"not run: --objective {args.objective} trains the other pair"
            null_reasons[f"heldout_kl_vs_trl_{kind}"] = null_reasons[f"seconds_per_update_vs_trl_{kind}"] = reason
            continue
        ratios[f"heldout_kl_vs_trl_{kind}"] = summary[ours]["heldout_kl"][last] / summary[peer]["heldout_kl"][last]
        # Each seed's own ratio: a median of two seeds says little where one collapses (docs/learning.md).
        per_seed[f"heldout_kl_vs_trl_{kind}"] = {
            str(s): round(sides[ours][s]["heldout_kl"][args.updates] / sides[peer][s]["heldout_kl"][args.updates], 4)
            for s in seeds
            if s in sides[ours] and s in sides[peer]
        }
        ratios[f"seconds_per_update_vs_trl_{kind}"] = (
            summary[ours]["seconds_per_update"] / summary[peer]["seconds_per_update"]
        )
    # The slower of the pairs that ran (--objective may leave one out).
    pair_speeds = [
        ratios[f"seconds_per_update_vs_trl_{p.removeprefix('trl_')}"] for p, ours in PAIRS.items() if ours in sides
    ]
    if pair_speeds and all(r is not None for r in pair_speeds):
        ratios["seconds_per_update_vs_trl"] = max(pair_speeds)
    else:
        null_reasons["seconds_per_update_vs_trl"] = missing
    return {
        "schema": "miniverl-bench-quality/1",
        "command": " ".join(["python -m miniverl.bench", *args.argv]),
        "models": {"student": str(args.student), "teacher": str(args.teacher)},
        "prompts": {"train": str(args.train), "heldout": str(args.heldout)},
        "updates": args.updates,
        "seeds": seeds,
        "objective": args.objective,  # --objective: both pairs, or the k1 or the full-vocabulary pair alone
        "miniverl_overrides": list(args.override),  # miniverl's sides only; TRL's keep the recipe's settings
        "ratios": {k: (round(v, 4) if v is not None else None) for k, v in ratios.items()},
        "heldout_kl_ratios_per_seed": per_seed,  # miniverl ÷ TRL at the last update, seed by seed
        "targets": TARGETS,
        "null_reasons": null_reasons,
        "sides": summary,
        "trl_workaround": "IWOPDTrainer: trainer.model_accepts_loss_kwargs=False (TRL 1.16 divides by the label "
        "tokens of a prompt-only dataset: zero)",
    }


def markdown(result: dict) -> str:
    updates = sorted({int(u) for side in result["sides"].values() for u in side["heldout_kl"]})
    head = " | ".join(f"KL @ {u}" for u in updates)
    lines = [
        f"# Learning per update: miniverl and TRL ({result['updates']} updates, seeds {result['seeds']}"
        + ("" if result["objective"] == "both" else f", the {result['objective']} pair only")
        + ")",
        "",
        f"Held-out exact reverse KL (median over the seeds; lower is better), measured by miniverl's probe. "
        f"`{result['command']}`",
        "",
        f"| side | computes | LoRA dtype | {head} | s/update |",
        "|---|---|---|" + "---|" * len(updates) + "---|",
    ]
    for name, side in result["sides"].items():
        kls = " | ".join(f"{side['heldout_kl'][str(u)]:.3f}" for u in updates)
        lines.append(
            f"| {name} | {side['computes']} | {side['adapter_dtype']} | {kls} | {side['seconds_per_update']:.2f} |"
        )
    lines += ["", "| ratio | value | target | met |", "|---|---|---|---|"]
    for key, value in result["ratios"].items():
        shown = f"{value:.3f}" if value is not None else f"null ({result['null_reasons'].get(key)})"
        met = "—" if value is None else ("yes" if value <= 1.0 else "**no**")  # every target is <= 1.0
        lines.append(f"| {key} | {shown} | {result['targets'][key]} | {met} |")
    if result["heldout_kl_ratios_per_seed"]:
        seeds = result["seeds"]
        lines += ["", f"Seed by seed, at update {result['updates']}:", ""]
        lines += ["| ratio | " + " | ".join(f"seed {s}" for s in seeds) + " | miniverl lower on | sign test p |"]
        lines += ["|---|" + "---|" * (len(seeds) + 2)]
        for key, by_seed in result["heldout_kl_ratios_per_seed"].items():
            shown = " | ".join(f"{by_seed[str(s)]:.3f}" if str(s) in by_seed else "—" for s in seeds)
            lower, higher = sum(r < 1.0 for r in by_seed.values()), sum(r > 1.0 for r in by_seed.values())
            p = sign_test_p(lower, higher)
            lines.append(f"| {key} | {shown} | {lower} of {len(by_seed)} seeds | {p:.2f} |")
        lines += [
            "",
            "sign test p: two-sided, the chance of a split at least this uneven if either side were as likely to "
            "end lower on a seed; two seeds give 0.50 at best, so only more seeds (--seeds) can tell a gap from "
            "the seeds.",
        ]
    lines += ["", f"TRL workaround: {result['trl_workaround']}.", ""]
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    # Per update, and per second: each probed update at the training time its seed had spent by then
    # (the sum of its updates' seconds; the probe's own time left out, as for every side).
    fig, (by_update, by_second) = plt.subplots(1, 2, figsize=(11.0, 4.0), sharey=True)
    for name, side in result["sides"].items():
        for i, runs in enumerate(side["seeds"].values()):
            points = sorted((int(u), v) for u, v in runs["heldout_kl"].items())
            spent = [sum(runs["update_seconds"][:u]) for u, _ in points]
            style = {
                "marker": "o",
                "alpha": 0.8,
                "color": f"C{list(SIDES).index(name)}",
                "linestyle": "-" if name.startswith("miniverl") else "--",
                "label": name if i == 0 else None,
            }
            by_update.plot([u for u, _ in points], [v for _, v in points], **style)
            by_second.plot(spent, [v for _, v in points], **style)
    by_update.set_xlabel("optimizer update")
    by_update.set_ylabel("held-out exact reverse KL")
    by_update.set_title("per update: every seed, the same probe for every side")
    by_second.set_xlabel("training seconds (rollout, scoring, update)")
    by_second.set_title("per second: the same runs")
    by_update.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))  # updates are whole
    by_update.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
