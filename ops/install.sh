#!/usr/bin/env bash
# Install Reel and its test dependencies on a fresh Debian machine (Python >= 3.11).
set -euo pipefail
cd "$(dirname "$0")/.."
# torch first and pinned: an unpinned torch can pull a multi-GB CUDA build.
python3 -m pip install -q torch==2.13.0
python3 -m pip install -q -e '.[test,embedded]'
