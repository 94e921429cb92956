#!/usr/bin/env bash
# Run Reel's whole test suite. What only the tests need is installed first (ops/install_test.sh:
# Debian's redis-server, Prometheus, Slurm, Mooncake, pytest; the Debian packages need root, and no
# service is left started or enabled). The tests start their own Redis servers; the `slurm` tests need
# the single-host Slurm cluster, started here and stopped again on exit; the `vllm` tests need vLLM,
# installed here (its CPU build on a machine without a GPU; ~2 minutes the first time, seconds after).
# The wheel, installed outside the clone, is checked by ops/test_wheel.sh. Extra arguments go to pytest.
# Tests run on REEL_TEST_WORKERS pytest-xdist workers (default 2: most whole-run tests wait on the
# roles they start, so two share two cores well; 0 runs them in this one process). The Slurm tests
# share one worker, as do the vLLM ones (tests/conftest.py).
#
# `--quick` runs the quick tier only (the inner loop, under five minutes on two cores): no test marked
# slow (whole runs: everything in tests/runs/, and other tests of tens of seconds), slurm or vllm; it
# installs what the tests need but skips the wheel check, vLLM and the Slurm cluster. CI runs everything.
set -euo pipefail
cd "$(dirname "$0")/.."
parallel=(-n "${REEL_TEST_WORKERS:-2}" --dist loadgroup)
if [ "${1:-}" = "--quick" ]; then
    shift
    bash ops/install_test.sh
    exec python3 -m pytest -q -p no:cacheprovider --durations=15 "${parallel[@]}" -m "not slow and not slurm and not vllm" "$@"
fi
bash ops/install_test.sh
bash ops/test_wheel.sh
# A GPU machine brings its own vLLM (pip install 'reel-rl[vllm]').
if [ "$(python3 -c 'import torch; print(int(torch.cuda.is_available()))')" = 0 ]; then
    bash ops/install_vllm.sh
fi
if ! ops/slurm/local_cluster.sh start; then
    echo "test.sh: could not start the local Slurm cluster (needs root to install slurm-wlm);" \
         "run as root, or pass -m 'not slurm' to leave the Slurm tests out" >&2
    exit 1
fi
trap 'ops/slurm/local_cluster.sh stop' EXIT
python3 -m pytest -q -p no:cacheprovider --durations=15 "${parallel[@]}" "$@"
