#!/usr/bin/env bash
# Install what the tests need on top of ops/install.sh (ops/test.sh runs this first), with no
# service left started or enabled (ops/apt_install.sh):
# - Debian's redis-server: the Redis every test session runs against (tests/conftest.py, checked to
#   be Redis 7 by tests/test_packaging.py), and the Slurm job's (bus/server.py service_redis_server);
# - prometheus: tests/consumers/test_prometheus.py scrapes `reel metrics serve` with a real one;
# - slurm-wlm and munge: the single-host cluster of the `slurm` tests (ops/slurm/local_cluster.sh);
# - libibverbs1: linked by Mooncake's transfer engine even over TCP (the `mooncake` extra's tests);
# - chromium: tests/replay/test_html_report.py renders `reel report` in a headless browser;
# - the `test`, `mooncake` and `pd` (vllm-router) extras, `tracking` (the W&B/TensorBoard/MLflow
#   sinks), `docs` (mkdocs build --strict) and `tasks` (reasoning-gym, verifiers 0.4, math-verify,
#   datasets), and the verifiers example's environment package (examples/vf_reverse.toml loads it by id).
# The Debian packages need root; without it, what is missing is named and the script fails.
set -euo pipefail
cd "$(dirname "$0")/.."
bash ops/apt_install.sh redis-server prometheus slurm-wlm munge libibverbs1 chromium
python3 -m pip install -q --no-compile -e '.[test,embedded,mooncake,pd,tracking,docs,tasks]'
python3 -m pip install -q --no-compile -e examples/vf_reverse
bash ops/byte_compile.sh  # every test process imports torch: compiled once here, not in each of them
