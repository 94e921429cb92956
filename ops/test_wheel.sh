#!/usr/bin/env bash
# Reel as a user installs it: build the wheel, install it (not editable) in a fresh venv, and use it
# from a directory outside the clone, where nothing of the clone can be imported:
#   `import bus` fails and `import reel.bus` works (from site-packages);
#   `reel example copy reverse_text`, then a 3-step `reel run` of it (a short warm-start),
#   `reel replay step 2` (bitwise) and `reel launch slurm --dry-run` (its Redis config found in the wheel).
# ops/test.sh runs it before the test suite: 3.5 minutes on the shared 2-core VM at load average ~5
# (pip 2 of them), 8 at ~13. It prints the time of each part.
set -euo pipefail
cd "$(dirname "$0")/.."
clone=$PWD
work=$(mktemp -d /tmp/reel-wheel.XXXXXX)
trap 'rm -rf "$work"' EXIT
say() { echo "test_wheel: $*" >&2; }
lap() { say "$1: $SECONDS s"; SECONDS=0; }

python3 -m pip wheel -q --no-deps -w "$work/dist" .
python3 -m venv "$work/venv"
export PATH="$work/venv/bin:$PATH" REEL_CACHE="$work/cache"
unset PYTHONPATH
# torch first and pinned: an unpinned torch can pull a multi-GB CUDA build. --no-compile: this venv's
# few processes compile what they import (with PYTHONDONTWRITEBYTECODE set, each one again), which
# costs less than byte-compiling all of torch for them (ops/byte_compile.sh).
python -m pip install -q --no-compile torch==2.13.0
python -m pip install -q --no-compile "$(ls "$work"/dist/reel_rl-*.whl)[embedded]"
lap "wheel built and installed"

mkdir "$work/user" && cd "$work/user"
if python -c "import bus" 2>/dev/null; then say "a top-level 'bus' module is importable"; exit 1; fi
python - "$clone" <<'PY'
import sys, sysconfig
import reel.bus
site = sysconfig.get_paths()["purelib"]
assert reel.bus.__file__.startswith(site), f"reel.bus comes from {reel.bus.__file__}, not {site}"
assert not reel.bus.__file__.startswith(sys.argv[1]), "reel.bus comes from the clone"
from reel.producers import sampling
from reel.runtime.weights import stream_copy
from reel.runtime.model import native
for kernel in (sampling, stream_copy, native):  # C sources ship in the wheel, compiled on first use
    assert kernel._SOURCE.is_file() and str(kernel._SOURCE).startswith(site), kernel._SOURCE
PY
reel example list >/dev/null
reel example copy reverse_text .
sed -i 's/^steps = 60$/steps = 3/; s/^warmup_steps = 300$/warmup_steps = 20/' reverse_text.toml
grep -qx "steps = 3" reverse_text.toml
reel run reverse_text.toml --no-live >run.log 2>&1 || { tail -30 run.log; say "reel run failed"; exit 1; }
lap "3-step run"
reel replay step 2 --run runs/reverse_text >replay.log 2>&1 || { tail -30 replay.log; say "replay step 2 failed"; exit 1; }
lap "replay step 2"
reel launch slurm reverse_text.toml --dry-run >job.sbatch
bash -n job.sbatch
conf=$(sed -n "s/^export REDIS_CONF=//p" job.sbatch)
[[ $conf == "$work"/venv/lib/python3*/site-packages/reel/ops/redis/redis.conf && -f $conf ]] \
    || { say "the job's REDIS_CONF ($conf) is not the wheel's redis.conf"; exit 1; }
say "passed: the wheel imports as reel.* only, and example copy, run, replay and launch slurm --dry-run work outside the clone"
