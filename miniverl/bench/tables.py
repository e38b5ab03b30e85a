"""The report: where it goes, each ratio's verdict against its target, one path's table rows, bench.md,
and the machine's facts."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from miniverl.bench.setups import BATCH, LORA, NEW_TOKENS, PATH_RATIO_KEYS, PREFIX, TARGETS
from miniverl.utils.errors import MiniverlError
from miniverl.utils.run_folder import holds_outputs


# ---------------------------------------------------------------------------------------------- report
@contextmanager
def result_folder(given: str | None, kind: str, result: str) -> Iterator[Path]:
    """The folder a bench writes `result` to (bench.json, quality.json, losses.json), made for the bench:
    `--out` as given, refused if an earlier bench's result is there (a measurement is never replaced
    unasked); by default a new folder per run, outputs/bench/<kind>/<date>/<time>, as a run's
    outputs/<date>/<time>. A bench that stops with nothing written there (a --student that is no
    model) leaves none of the folders it made."""
    if given is not None:
        out = Path(given)
        if in_the_way := next((p for p in (out, *out.parents) if p.exists() and not p.is_dir()), None):
            raise MiniverlError(f"--out {out}: {in_the_way} is a file, not a folder; choose another --out")
        if holds_outputs(out):  # a training run's folder: its resume and report read what is there
            raise MiniverlError(
                f"--out {out} holds a training run's files, which the bench never writes beside: choose another --out"
            )
        if (out / result).exists():
            raise MiniverlError(
                f"--out {out} holds an earlier bench's {result}: give another --out (or leave it out: a new "
                f"folder under outputs/bench/{kind}/), or remove that one"
            )
    else:
        out = Path("outputs") / "bench" / kind / time.strftime("%Y-%m-%d") / time.strftime("%H-%M-%S")
        while out.exists():  # two benches in one second
            out = out.with_name(out.name + "_")
    made = [folder for folder in (out, *out.parents) if not folder.exists()]  # deepest first
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as error:  # a parent no folder can be made in (/proc), or no permission, a full disk
        raise MiniverlError(f"cannot write {error.filename or out}: {error.strerror}; choose another --out") from None
    try:
        yield out
    except BaseException:
        for folder in made:  # an earlier side's runs stay: only what is still empty goes
            if folder.is_dir() and not any(folder.iterdir()):
                folder.rmdir()
        raise


def verdict(key: str, value: float | None) -> str:
    if key not in TARGETS:
        return "—"
    if value is None:
        return "n/a"
    op, bound = TARGETS[key]
    return "yes" if (value >= bound if op == ">=" else value <= bound) else "no"


def mib(b: int | None) -> str:
    return f"{b / 2**20:.1f} MiB" if b is not None else "n/a"


def path_rows(result: dict, path: str) -> list[tuple[str, str, str, str | None, float | None]]:
    """(label, miniverl, other, ratio key or None, ratio) of one path's table."""
    m, r, prefix = result["measurements"][path], result["ratios"], PREFIX[path]
    ro, sc, up, step = m["rollout"], m["scoring"], m["update"], m["opd_step"]

    def tps(name: str) -> str:
        return f"{ro[name]['tokens_per_s']:.1f}" if name in ro else "n/a"

    def seconds_of(part: dict | None) -> str:
        return f"{part['best_step_seconds']:.3f} s" if part else "n/a"

    rows = [
        (
            "rollout tokens/s vs `model.generate(use_cache=True)`, batch 4",
            tps("miniverl"),
            tps("hf_generate"),
            prefix + "rollout_vs_hf_generate",
        )
    ]
    if path in ("recipe", "real"):
        rows.append(
            (
                "rollout tokens/s vs the same loop on bitsandbytes' per-call dequantization (every token)",
                tps("miniverl"),
                tps("miniverl_per_call_dequantize"),
                prefix + "rollout_vs_per_call_dequantize",
            )
        )
    rows += [
        (
            "rollout tokens/s vs one row at a time (`generate(use_cache=True)`, batch 1, each prompt alone"
            + (
                f"; best of {len(ro['one_row_generate']['runs'])} rounds, the slowest method"
                if "one_row_generate" in ro
                else ""
            )
            + ")",
            tps("miniverl"),
            tps("one_row_generate"),
            prefix + "rollout_vs_one_row_generate",
        ),
        *(
            [
                (
                    "teacher scoring positions/s vs one plain forward + log-softmax + gather (the teacher as shipped)",
                    f"{sc['positions'] / sc['miniverl_seconds']:.0f}",
                    f"{sc['positions'] / sc['hf_forward_seconds']:.0f}",
                    "real_scoring_vs_hf_forward",
                )
            ]
            if "hf_forward_seconds" in sc
            else []
        ),
        (
            "teacher scoring time vs `log_softmax(logits.float()).gather` (the same teacher, miniverl's products)",
            f"{sc['miniverl_seconds']:.4f} s",
            f"{sc['naive_seconds']:.4f} s",
            prefix + "scoring_time_vs_naive",
        ),
        (
            "teacher scoring peak memory vs the same",
            mib(sc.get("miniverl_peak_bytes")),
            mib(sc.get("naive_peak_bytes")),
            prefix + "scoring_peak_memory_vs_naive",
        ),
        (
            (
                "one OPD update (k1 on the sampled token) vs TRL `DistillationTrainer` step (beta=1: full-vocabulary "
                "reverse KL + entropy at every response position, both models)"
            ),
            seconds_of(step["full_vocab"]["miniverl"]),
            seconds_of(step["full_vocab"]["trl"]),
            prefix + "opd_step_vs_trl",
        ),
        (
            "update positions/s vs bare forward+backward",
            f"{up['miniverl_positions_per_s']:.1f}",
            f"{up['bare_fwd_bwd_positions_per_s']:.1f}",
            prefix + "update_vs_bare_fwd_bwd",
        ),
    ]
    if "k1" in step:
        rows.insert(
            -1,
            (
                (
                    "one OPD update vs TRL as close to k1 as it goes: experimental `IWOPDTrainer` (`iw_opd`, "
                    "gamma=0: the same sampled-token k1 policy gradient, from both models' full logits)"
                ),
                seconds_of(step["k1"]["miniverl"]),
                seconds_of(step["k1"]["trl"]),
                prefix + "opd_step_vs_trl_k1",
            ),
        )
    out = [(label, ours, other, key, r.get(key)) for label, ours, other, key in rows]
    decode = ro["miniverl"].get("decode")
    fp16_head = "; the lm_head from its float16 copy" if ro["miniverl"].get("fp16_head_bytes") else ""
    reordered = "; reordered for oneDNN" if ro["miniverl"].get("reordered_layers") else ""
    if decode and "fraction_of_bandwidth" in decode:
        out.insert(
            1,
            (
                (
                    f"decode: weight bytes read per step ({decode['weight_bytes_per_token'] / 2**20:.0f} MiB per token "
                    f"of a row{fp16_head}) "
                    "and per second vs this machine's memory bandwidth (a copy's read + write)"
                ),
                f"{decode['weight_bytes_per_s'] / 1e9:.1f} GB/s",
                f"{decode['memory_bandwidth_bytes_per_s'] / 1e9:.1f} GB/s",
                None,
                decode["fraction_of_bandwidth"],
            ),
        )
    if path in ("recipe", "real") and ro["miniverl"]["four_bit_storage_bytes"]:
        held, stored = ro["miniverl"]["dequantized_bytes"], ro["miniverl"]["four_bit_storage_bytes"]
        out.insert(
            2,
            (
                (
                    "rollout memory: dense copies of the student's 4-bit weights while decoding (freed after"
                    f"{reordered}) vs their NF4 storage"
                ),
                mib(held),
                mib(stored),
                None,
                held / stored,
            ),
        )
    return out


PATH_TITLES = {
    "recipe": "Recipe path (what `+recipe=opd_k1` runs): NF4 student (bf16 compute, prepare_model_for_kbit_training, "
    "LoRA r16 on q/v, gradient checkpointing) and NF4 teacher, loaded by miniverl's own loaders",
    "float32": "Unquantized float32 models (bfloat16 on CUDA), the same shapes: extra rows",
    "real": "Your models (--student/--teacher), loaded as `+recipe=opd_k1` loads them: NF4 student (compute in the "
    "checkpoint's dtype, prepare_model_for_kbit_training, LoRA r16 on q/v or, in a family without them, all-linear, "
    "gradient checkpointing) and NF4 teacher; "
    "`generate`, the plain forward and TRL on copies with bitsandbytes as shipped",
}


def lora_layers(targets: str | list[str]) -> str:
    return "q/v" if targets == ["q_proj", "v_proj"] else targets if isinstance(targets, str) else ", ".join(targets)


def markdown(result: dict) -> str:
    s = result["settings"]
    lines = [
        (
            f"miniverl bench, scale `{result['scale']}` on {result['machine']['device_name']} "
            f"({result['machine']['torch_threads']} torch threads), batch {BATCH}, {NEW_TOKENS} new tokens, "
            f"LoRA r{LORA['r']} on {lora_layers(s['lora']['target_modules'])}; `{result['command']}`"
        )
    ]
    smoke = result["scale"] == "toy"  # milliseconds of Python overhead: no target is judged on it
    if smoke:
        lines += ["", "Scale `toy` is a smoke run: its models are too small for a target to say anything (met: —)."]
    for path in result["paths"]:
        lines += [
            "",
            f"{PATH_TITLES[path]} (best of {s['repeats'][path]} interleaved rounds):",
            "",
            "| measurement | miniverl | other | ratio (miniverl ÷ other) | target | met |",
            "|---|---|---|---|---|---|",
        ]
        for label, ours, other, key, value in path_rows(result, path):
            shown = f"{value:.2f}" if value is not None else "null"
            if key in TARGETS:
                op, bound = TARGETS[key]
                target = f"{'≥' if op == '>=' else '≤'} {bound}"
            else:
                target = "—"
            met = "—" if smoke else verdict(key, value)
            lines.append(f"| {label} | {ours} | {other} | {shown} | {target} | {met} |")
    lines += [
        "",
        (
            "What each TRL row computes: `DistillationTrainer` (beta=1) the full-vocabulary reverse KL and "
            "the entropy at every response position of both models, miniverl the single-sample k1 on the "
            "sampled token; `IWOPDTrainer` with `iw_opd_gamma=0` the same sampled-token k1 policy gradient as "
            "miniverl, from both models' full (B, L, V) logits. `DistillationTrainer` itself has no sampled-token "
            "option: its loss is always the chunked full-vocabulary generalized JSD."
        ),
    ]
    if result["machine"]["device"] == "cpu" and s["hardware"]["cpu_float32_gemm"]:
        lines += [
            "",
            (
                "Kernels: miniverl's roles and its in-house baselines (naive scoring, bare forward+backward) "
                "multiply the bf16 layers as float32 GEMMs of the same bf16 operands, rounded to bf16 "
                "(`hardware.cpu_float32_gemm`, miniverl/models/cpu_gemm.py); `generate` and TRL run bitsandbytes' "
                "and PyTorch's bf16 products as shipped. On a CPU without bf16 instructions that choice "
                "alone is most of the recipe path's lead; on CUDA both sides run bf16 kernels. "
                "`--no-cpu-float32-gemm` measures miniverl on the shipped products too."
            ),
        ]
    measured_keys = {key for path in result["paths"] for key in PATH_RATIO_KEYS[path]}
    for key, reason in result["null_reasons"].items():
        if key not in measured_keys:
            continue  # a path not run: bench.json says why
        lines.append(f"\n`{key}` is null: {reason}")
    return "\n".join(lines) + "\n"


def machine_facts(device: torch.device) -> dict:
    from miniverl.utils.device import hardware_facts

    facts = hardware_facts(device)
    facts["device_name"] = facts["gpu"] if device.type == "cuda" else f"{facts['cpu']} ({facts['cpu_count']} cores)"
    try:
        import trl

        facts["trl"] = trl.__version__
    except ImportError:
        facts["trl"] = None
    return facts
