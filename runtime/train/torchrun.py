"""How N trainer ranks start: torchrun's command line, without importing torch.

The launcher (`reel run`), `reel replay` and `reel retrain` start ranks with it; importing torch
costs a process seconds of CPU, and the launcher itself trains nothing (runtime/train/distributed.py
is what the ranks run).
"""

from __future__ import annotations

import os
import subprocess
import sys


def torchrun_argv(ranks: int, module: str = "reel.runtime.launch.cli") -> list[str]:
    """Python arguments that start `module` (its arguments follow) as `ranks` local processes of one
    torch.distributed group; when any of them fails, torchrun stops the others."""
    # "--": torchrun would otherwise take an argument such as --run for an abbreviated option.
    return ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", "--max-restarts=0",
            "-m", "--", module]


def relaunch(ranks: int, cli_args: list[str], threads: int) -> int:
    """Run `reel CLI_ARGS` again as `ranks` local processes; prints what they print; their exit code."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1")
    argv = [sys.executable, *torchrun_argv(ranks), *cli_args]
    done = subprocess.run(argv, env=env, stdout=subprocess.PIPE, text=True)
    print(done.stdout, end="")
    return done.returncode
