#!/usr/bin/env bash
# Run Reel's whole test suite. The tests start their own Redis servers; the `slurm` tests need
# the single-host Slurm cluster, started here (installing slurm-wlm + munge needs root) and
# stopped again on exit; the `vllm` tests need vLLM, installed here (its CPU build on a machine
# without a GPU; ~2 minutes the first time, seconds after). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
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
python3 -m pytest -q -p no:cacheprovider --durations=15 "$@"
