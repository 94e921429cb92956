#!/usr/bin/env bash
# Byte-compile the active Python's installed packages and Reel's own source, on every core.
# Where PYTHONDONTWRITEBYTECODE is set (the CI machines of this project set it), Python never writes
# the .pyc files it compiles, so every process compiled torch and Reel from source again: ~1.5 CPU s
# of each role's start (importing the trainer role took 3.4 CPU s, 1.8 once compiled; 2026-12-05,
# 2-core machine). The pip installs pass --no-compile because pip compiles on one core; this uses all
# of them and skips what is compiled already (~13 s then, ~26 s the first time). A few files in
# third-party packages are not Python 3 (templates, test data) and fail to compile: that is expected,
# and what they belong to never imports them.
set -euo pipefail
cd "$(dirname "$0")/.."
site=$(python3 -c "import sysconfig; print(*sorted({sysconfig.get_paths()[k] for k in ('purelib', 'platlib')}))")
# shellcheck disable=SC2086  # one or two directories, none with spaces
python3 -m compileall -q -j 0 $site bus producers consumers runtime replay ops >/dev/null 2>&1 || true
