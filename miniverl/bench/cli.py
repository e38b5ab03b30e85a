"""The command line: `parse_args`, `run` (both paths' models and measurements, then bench.json and
bench.md) and `main`."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch

from miniverl.bench.measuring import PeakMemory, peak_memory
from miniverl.bench.opd_step import TRL_COMPUTES
from miniverl.bench.pieces import measure_path
from miniverl.bench.setups import (
    BATCH,
    LORA,
    NEW_TOKENS,
    PATH_RATIO_KEYS,
    PATHS,
    PREFIX,
    RATIO_KEYS,
    RUN_KEYS,
    SCALES,
    SCHEMA,
    TARGETS,
    build_float32_setup,
    build_real_setup,
    build_recipe_setup,
)
from miniverl.bench.tables import machine_facts, markdown, result_folder
from miniverl.models import cpu_gemm
from miniverl.utils.errors import MiniverlError, ctrl_c_stop, exit_code_of, unwritable
from miniverl.workers.rollout.lean_decode import resolved_decode_settings

log = logging.getLogger("miniverl.bench")


# ---------------------------------------------------------------------------------------------- main
@contextmanager
def quiet():
    import transformers

    previous = transformers.utils.logging.get_verbosity()
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        transformers.utils.logging.set_verbosity(previous)


# The options of bench --quality alone (argparse's dest names).
QUALITY_ONLY = ("train", "heldout", "seeds", "first_seed", "updates", "objective", "override")


def parse_args(argv: list[str]) -> argparse.Namespace:
    import miniverl.bench
    from miniverl.config.hardware import HardwareConfig

    defaults = HardwareConfig()
    p = argparse.ArgumentParser(prog="python -m miniverl.bench", description=miniverl.bench.__doc__.split("\n\n")[0])
    p.add_argument(
        "--scale",
        choices=sorted(SCALES),
        default="bench",
        help="the random-weight models' size (bench/setups.py SCALES; default bench); ignored with --student",
    )
    p.add_argument(
        "--path",
        choices=("both", *PATHS),
        default="both",
        help="recipe: NF4 + LoRA as +recipe=opd_k1 (keys recipe_*); float32: unquantized (today's keys)",
    )
    p.add_argument(
        "--student",
        default=None,
        help="your own student (a Hugging Face folder): the bench then measures it (the real path)",
    )
    p.add_argument("--teacher", default=None, help="your own teacher, with --student")
    p.add_argument(
        "--quality",
        action="store_true",
        help="learning per update and per second: miniverl and TRL trained on --student/--teacher (bench/quality.py)",
    )
    p.add_argument(
        "--losses",
        action="store_true",
        help="the memory of the losses' forward + backward: token selection, chunked top-k (bench/loss_memory.py)",
    )
    p.add_argument("--vocab", type=int, default=8192, help="--losses: the small models' vocabulary (>= 16)")
    p.add_argument("--train", default="data/toy_prompts.parquet", help="--quality: the training prompts (verl parquet)")
    p.add_argument(
        "--heldout", default="data/toy_prompts_heldout.parquet", help="--quality: the held-out prompts of the probe"
    )
    p.add_argument("--seeds", type=int, default=2, help="--quality: N seeds for every side (default 2)")
    p.add_argument("--first-seed", type=int, default=1, help="--quality: the seeds are FIRST..FIRST+N-1 (default 1)")
    p.add_argument(
        "--updates", type=int, default=16, help="--quality: optimizer updates per side (default 16, at least 2)"
    )
    p.add_argument(
        "--objective",
        choices=("both", "k1", "full"),
        default="both",
        help="--quality: both pairs (default), or only the k1 pair (miniverl_k1, trl_iwopd) or the "
        "full-vocabulary pair (miniverl_full, trl_distill): half the time; the other pair's ratios are null",
    )
    p.add_argument(
        "--override",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="--quality: a Hydra override for miniverl's two sides only (repeatable), e.g. --override "
        "data.shuffle=true; TRL's sides keep the recipe's settings: one difference ablated against the same peers",
    )
    p.add_argument(
        "--out",
        default=None,
        help="output folder, refused if it holds an earlier bench's result (default: a new one per run, "
        "outputs/bench/<scale, real, quality or losses>/<date>/<time>)",
    )
    p.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="auto: CUDA when torch sees a GPU, else the CPU",
    )
    p.add_argument(
        "--repeats", type=int, default=None, help="timed rounds per measurement (default per scale and path)"
    )
    p.add_argument("--no-trl", action="store_true", help="skip TRL (the opd_step_vs_trl* ratios are then null)")
    p.add_argument("--logprob-chunk", type=int, default=defaults.logprob_chunk, help="hardware.logprob_chunk")
    # The decode and product switches of `hardware`, each as --flag / --no-flag (default: the config's).
    switches = (
        ("--static-cache", "rollout_static_cache", ""),
        ("--compile-decode", "rollout_compile", ""),
        ("--cpu-gemv", "rollout_cpu_gemv", " (default: by the CPU)"),
        ("--cpu-prepack", "rollout_cpu_prepack", " (default: by the CPU)"),
        ("--cpu-fp16-lm-head", "rollout_cpu_fp16_lm_head", " (default: by the CPU)"),
        (
            "--cpu-float32-gemm",
            "cpu_float32_gemm",
            " (miniverl's roles and in-house baselines; never the peers); default: by the CPU (float32 "
            "without bf16 instructions)",
        ),
    )
    for flag, key, more in switches:
        p.add_argument(
            flag, action=argparse.BooleanOptionalAction, default=getattr(defaults, key), help=f"hardware.{key}{more}"
        )
    args = p.parse_args(argv)
    if (args.student is None) != (args.teacher is None):
        p.error("--student and --teacher go together")
    if args.losses and (args.quality or args.student or args.device == "cuda"):
        p.error(
            "--losses measures the losses on small random models on the CPU: leave out --quality/--student/--device"
        )
    if args.losses and args.vocab < 16:
        p.error(f"--vocab {args.vocab}: give at least 16 (the top-k losses take k = 8)")
    if args.vocab != 8192 and not args.losses:
        p.error("--vocab sizes the models of --losses only")
    if args.quality and not args.student:
        p.error("--quality trains on your models: give --student and --teacher")
    # Read by --quality alone: given without it, the speed bench would run and leave them unread.
    unread = [f"--{name.replace('_', '-')}" for name in QUALITY_ONLY if getattr(args, name) != p.get_default(name)]
    if unread and not args.quality:
        p.error(
            f"{', '.join(unread)} set{'s' if len(unread) == 1 else ''} bench --quality: add --quality, or leave "
            f"{'it' if len(unread) == 1 else 'them'} out"
        )
    if args.repeats is not None and args.repeats < 1:
        p.error(f"--repeats {args.repeats}: give at least 1 timed round (leave it out for the default per scale)")
    if args.logprob_chunk < 1:
        p.error(f"--logprob-chunk {args.logprob_chunk}: give at least 1 position per log-prob chunk")
    if args.quality and (args.seeds < 1 or args.updates < 2):
        p.error("--quality needs --seeds >= 1 and --updates >= 2")
    if args.student and args.path != "both":
        p.error("--path chooses between the random-weight paths; with --student/--teacher the bench runs the real path")
    args.argv = list(argv)
    return args


def run(args: argparse.Namespace, out: Path) -> dict:
    from miniverl.config.hardware import HardwareConfig

    if args.device == "cuda" and not torch.cuda.is_available():
        raise MiniverlError(f"--device cuda: torch sees no GPU (torch {torch.__version__}); use --device cpu")
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    hw = HardwareConfig(
        device=device.type,
        logprob_chunk=args.logprob_chunk,
        rollout_static_cache=args.static_cache,
        rollout_compile=args.compile_decode,
        rollout_cpu_gemv=args.cpu_gemv,
        rollout_cpu_prepack=args.cpu_prepack,
        rollout_cpu_fp16_lm_head=args.cpu_fp16_lm_head,
        cpu_float32_gemm=args.cpu_float32_gemm,
    )
    real = args.student is not None
    paths = ("real",) if real else PATHS if args.path == "both" else (args.path,)
    repeats = {
        path: args.repeats or SCALES[args.scale]["recipe_repeats" if path != "float32" else "repeats"]
        for path in (*PATHS, "real")
    }
    command = " ".join(["python -m miniverl.bench", *args.argv])
    started = time.perf_counter()
    memory = PeakMemory(device)
    ratios = dict.fromkeys(RATIO_KEYS)
    null_reasons, measured, setups = {}, {}, {}
    builders = {
        "recipe": build_recipe_setup,
        "float32": build_float32_setup,
        "real": lambda scale, device, folder: build_real_setup(args.student, args.teacher, device),
    }
    with quiet(), tempfile.TemporaryDirectory(dir=out) as workdir:
        for path in paths:
            folder = Path(workdir) / path
            folder.mkdir()
            log.info("%s: models", path)
            s = setups[path] = builders[path](args.scale, device, folder)
            measured[path] = measure_path(s, hw, repeats[path], args.no_trl, folder)
            ratios.update(measured[path]["ratios"])
            null_reasons.update(measured[path]["null_reasons"])
        log.info("peak memory")  # last: pinning glibc's mmap threshold slows allocation
        for path in paths:
            peaks = peak_memory(memory, measured[path]["calls"], rounds=2 if path == "recipe" else 3)
            measured[path]["measurements"]["scoring"].update(
                miniverl_peak_bytes=peaks["miniverl"], naive_peak_bytes=peaks["naive"]
            )
            key = PREFIX[path] + "scoring_peak_memory_vs_naive"
            ratios[key] = peaks["miniverl"] / peaks["naive"] if peaks["naive"] else None
            if memory.reason:
                null_reasons[key] = memory.reason
    for path in (*PATHS, "real"):
        if path not in paths:
            if path == "real":
                why = "not measured (no --student/--teacher)"
            elif real:
                why = "not measured (--student/--teacher: the real path only)"
            else:
                why = f"not measured (--path {args.path})"
            null_reasons.update(dict.fromkeys(PATH_RATIO_KEYS[path], why))
    float32_gemm = cpu_gemm.enabled_for(hw, device)
    shape = {k: v for k, v in SCALES[args.scale].items() if k not in RUN_KEYS}
    if real:
        shape = {k: getattr(setups["real"].student.get_base_model().config, k, None) for k in shape}
    shape["vocab_size"] = next(iter(setups.values())).student.get_base_model().config.vocab_size
    result = {
        "schema": SCHEMA,
        "command": command,
        "scale": "real" if real else args.scale,
        "paths": list(paths),
        "ratios": {k: (round(ratios[k], 4) if ratios[k] is not None else None) for k in RATIO_KEYS},
        "targets": {k: f"{op} {bound}" for k, (op, bound) in TARGETS.items()},
        "null_reasons": null_reasons,
        "settings": {
            "batch": BATCH,
            "new_tokens": NEW_TOKENS,
            "lora": {**LORA, "target_modules": setups[paths[0]].lora_targets},  # the paths' own, shared
            "student_gradient_checkpointing": True,
            "repeats": {p: repeats[p] for p in paths},
            "shape": shape,
            "models": {p: setups[p].description for p in paths},
            "trl": TRL_COMPUTES,
            "hardware": {
                "logprob_chunk": hw.logprob_chunk,
                "rollout_static_cache": hw.rollout_static_cache,
                "rollout_compile": hw.rollout_compile,
                **resolved_decode_settings(hw),  # as resolved here
                "rollout_dequantize_4bit_once": hw.rollout_dequantize_4bit_once,
                "cpu_float32_gemm": float32_gemm,  # as resolved on this machine
                "products": cpu_gemm.product_name(float32_gemm, device),
            },
            "prompt_tokens": [len(p) for p in next(iter(setups.values())).prompt_ids],
        },
        "measurements": {p: measured[p]["measurements"] for p in paths},
        "machine": machine_facts(device),
        "bench_seconds": round(time.perf_counter() - started, 2),
    }
    (out / "bench.json").write_text(json.dumps(result, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    table = markdown(result)
    (out / "bench.md").write_text(table, encoding="utf-8")
    print(table)
    print(f"wrote {out / 'bench.json'} and {out / 'bench.md'} ({result['bench_seconds']} s)")
    return result


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        args = parse_args(sys.argv[1:] if argv is None else argv)
        if args.quality:
            from miniverl.bench.quality import run as bench

            kind, result = "quality", "quality.json"
        elif args.losses:
            from miniverl.bench.loss_memory import run as bench

            kind, result = "losses", "losses.json"
        else:
            bench, kind, result = run, "real" if args.student else args.scale, "bench.json"
        with result_folder(args.out, kind, result) as out:
            bench(args, out)
    except KeyboardInterrupt:  # the results are written once every measurement is done
        stop = ctrl_c_stop(
            "stopped by SIGINT before the bench finished (its results are written at the end): run it again"
        )
        return exit_code_of(stop, "miniverl.bench")
    except MiniverlError as error:  # a folder that is not a model, a pair that cannot be distilled
        return exit_code_of(error, "miniverl.bench")
    except OSError as error:
        return exit_code_of(unwritable(error, "choose another --out"), "miniverl.bench")
    return 0
