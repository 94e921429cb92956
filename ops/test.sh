#!/usr/bin/env bash
# Run Reel's whole test suite. The tests start their own Redis servers; the `slurm` tests need
# the single-host Slurm cluster, started here (installing slurm-wlm + munge needs root) and
# stopped again on exit. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! ops/slurm/local_cluster.sh start; then
    echo "test.sh: could not start the local Slurm cluster (needs root to install slurm-wlm);" \
         "run as root, or pass -m 'not slurm' to leave the Slurm tests out" >&2
    exit 1
fi
trap 'ops/slurm/local_cluster.sh stop' EXIT
python3 -m pytest -q -p no:cacheprovider --durations=15 "$@"
