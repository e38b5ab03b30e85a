#!/usr/bin/env bash
# The GPU check on a machine without a package index (docs/testing.md, "A GPU machine without a
# package index"): pack here what it lacks, unpack it there.
#
#   bash scripts/offline_pack.sh pack [DIR]       # here, where pip reaches an index (default DIR outputs/offline_pack)
#   bash scripts/offline_pack.sh unpack DIR...    # there, in the repository root; prints the PYTHONPATH to export
#
# pack writes DIR/site.tar.gz (the packages below at this environment's versions, installed for the
# target's Python; of bitsandbytes' CUDA libraries only the target's) and the real fixture's GGUF
# file in chunks (DIR/gguf.part-aa, -ab, ...; DIR/gguf.sha256), for a transfer that takes a limited
# size at a time. unpack extracts the site into $PACK_SITE (default /tmp/site) and collects the
# chunks it is given (from one call or several) in $MINIVERL_CACHE/downloads/parts/; once all are
# there it joins them, checks the sha256 and puts the GGUF where python -m miniverl.real_models
# looks first.
#
# Environment (pack): PYTHON (default python), PACK_PYTHON_VERSION (the target's Python, default
# 3.12), PACK_CUDA (bitsandbytes' library kept, by torch.version.cuda there without the dot,
# default 130), PACK_PACKAGES (default below: what miniverl needs beyond a CUDA image with torch,
# transformers, accelerate, numpy, pyarrow and matplotlib), PACK_CHUNK (default 50M).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python}"
CACHE="${MINIVERL_CACHE:-$HOME/.cache/miniverl}"
GGUF_NAME=SmolLM2-135M-Instruct.Q4_1.gguf  # miniverl/models/real_fixture.py, GGUF_MEMBER

pack() {
    local dir packages wheels site version
    dir="$(realpath -m "${1:-outputs/offline_pack}")"
    packages="${PACK_PACKAGES:-bitsandbytes peft hydra-core omegaconf antlr4-python3-runtime gguf pylatexenc trl datasets dill multiprocess}"
    mkdir -p "$dir" && wheels="$(mktemp -d)" && site="$wheels/site"
    local target=(--python-version "${PACK_PYTHON_VERSION:-3.12}" --implementation cp --platform manylinux_2_28_x86_64
        --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
    for name in $packages; do
        version="$("$PYTHON" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$name")"
        # a wheel for the target; a package published only as source (antlr4's runtime) is built here
        "$PYTHON" -m pip download -q --no-deps --only-binary=:all: "${target[@]}" -d "$wheels" "$name==$version" 2>/dev/null \
            || "$PYTHON" -m pip wheel -q --no-deps -w "$wheels" "$name==$version"
    done
    "$PYTHON" -m pip install -q --no-deps --no-compile --only-binary=:all: "${target[@]}" --target "$site" "$wheels"/*.whl
    find "$site/bitsandbytes" -name 'libbitsandbytes_*.so' -not -name "*cuda${PACK_CUDA:-130}.so" -not -name '*_cpu.so' -delete
    tar -C "$wheels" -czf "$dir/site.tar.gz" site
    "$PYTHON" -c "from miniverl.models import real_fixture as r; from miniverl.config.model import cache_root; r.fetch_gguf(cache_root())"
    rm -f "$dir"/gguf.part-*
    split -b "${PACK_CHUNK:-50M}" "$CACHE/downloads/$GGUF_NAME" "$dir/gguf.part-"
    (cd "$CACHE/downloads" && sha256sum "$GGUF_NAME") > "$dir/gguf.sha256"
    ls "$dir"/gguf.part-* | wc -l | tr -d ' ' > "$dir/gguf.parts"
    rm -rf "$wheels"
    ls -la "$dir"
}

unpack() {
    local site="${PACK_SITE:-/tmp/site}" parts="$CACHE/downloads/parts"
    mkdir -p "$parts"
    for dir in "$@"; do
        [ -d "$dir" ] || { echo "offline_pack.sh unpack: no folder $dir (paths are from the repository root)" >&2; exit 2; }
        if [ -f "$dir/site.tar.gz" ]; then
            rm -rf "$site" && mkdir -p "$site" && tar -C "$site" --strip-components=1 -xzf "$dir/site.tar.gz"
        fi
        cp "$dir"/gguf.* "$parts/" 2>/dev/null || true
    done
    local have want
    have="$(find "$parts" -name 'gguf.part-*' | wc -l)"
    want="$(cat "$parts/gguf.parts" 2>/dev/null || echo '?')"
    if [ "$have" = "$want" ]; then
        # joined and checked beside the chunks: only a file that matches its sha256 reaches downloads/
        cat "$parts"/gguf.part-* > "$parts/$GGUF_NAME"
        (cd "$parts" && sha256sum -c gguf.sha256) \
            || { echo "the joined GGUF does not match its sha256: delete $parts and unpack fresh chunks" >&2; exit 1; }
        mv "$parts/$GGUF_NAME" "$CACHE/downloads/$GGUF_NAME" && rm -rf "$parts"
    else
        echo "the GGUF: $have of $want chunks here; unpack the others to complete it"
    fi
    echo "export PYTHONPATH=$PWD:$site"
}

case "${1:-}" in
    pack) shift; pack "$@" ;;
    unpack) shift; unpack "$@" ;;
    *) echo "usage: bash scripts/offline_pack.sh pack [DIR] | unpack DIR..." >&2; exit 2 ;;
esac
