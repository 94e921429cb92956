#!/usr/bin/env bash
# Install what the tests need on top of ops/install.sh (ops/test.sh runs this first), with no
# service left started or enabled (ops/apt_install.sh):
# - Debian's redis-server: the Redis every test session runs against (tests/conftest.py, checked to
#   be Redis 7 by tests/test_packaging.py), and the Slurm job's (bus/server.py service_redis_server);
# - prometheus: tests/test_prometheus.py scrapes `reel metrics serve` with a real one;
# - slurm-wlm and munge: the single-host cluster of the `slurm` tests (ops/slurm/local_cluster.sh);
# - libibverbs1: linked by Mooncake's transfer engine even over TCP (the `mooncake` extra's tests);
# - the `test` and `mooncake` extras.
# The Debian packages need root; without it, what is missing is named and the script fails.
set -euo pipefail
cd "$(dirname "$0")/.."
bash ops/apt_install.sh redis-server prometheus slurm-wlm munge libibverbs1
python3 -m pip install -q -e '.[test,embedded,mooncake]'
