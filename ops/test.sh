#!/usr/bin/env bash
# Run Reel's whole test suite (a private redis-server is started by the tests themselves).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pytest -q -p no:cacheprovider "$@"
