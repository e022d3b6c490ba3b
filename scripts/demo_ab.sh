#!/usr/bin/env bash
# A/B of `flyspec demo --max-minutes 10` between an older commit and this checkout, natively and with
# AVX2 emulated, one run after another (keep the machine otherwise idle). BENCHMARKS.md has the results.
#   bash scripts/demo_ab.sh [OLD_COMMIT] [OUT_DIR]      (defaults: 7a1aa61, ./demo-ab)
# Each run gets its own FLYSPEC_CACHE (the models linked in, kernel checks measured afresh); the outputs
# are OUT_DIR/NAME.out (the report's JSON), NAME.err (the log, then /usr/bin/time -v) and times.txt.
set -u
repo=$(cd "$(dirname "$0")/.." && pwd)
old_commit=${1:-7a1aa61}
out=$(mkdir -p "${2:-demo-ab}" && cd "${2:-demo-ab}" && pwd)
py=${PYTHON:-$repo/.venv/bin/python}
models=${FLYSPEC_CACHE:-$HOME/.cache/flyspec}/models
old="$out/old-code"
[ -d "$old" ] || git -C "$repo" worktree add --detach "$old" "$old_commit"
# The old commit predates FLYSPEC_CPU_ISA: cap the libraries directly, and use torch's int4 kernel (its
# own needed AVX-512 VNNI; an AVX2-only CPU fell back to torch's the same way).
avx2_old="ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 FLYSPEC_INT4_KERNEL=torch"
run() {  # name, code dir, extra environment
    local name=$1 code=$2
    shift 2
    mkdir -p "$out/cache-$name"
    ln -sfn "$models" "$out/cache-$name/models"
    rm -f "$out/$name.db"*
    echo "== $name $(date -u +%H:%M:%S)" >> "$out/times.txt"
    (cd "$out" && env FLYSPEC_CACHE="$out/cache-$name" PYTHONPATH="$code" "$@" /usr/bin/time -v "$py" -c \
        "from flyspec.cli import main; main()" demo --max-minutes 10 --store "$name.db" --json \
        > "$name.out" 2> "$name.err")
    echo "   rc=$? $(date -u +%H:%M:%S)" >> "$out/times.txt"
}
run old-native "$old"
run new-native "$repo"
run old-avx2 "$old" env $avx2_old
run new-avx2 "$repo" env FLYSPEC_CPU_ISA=avx2
