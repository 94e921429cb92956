"""Files Reel ships beside its code, found through importlib.resources.

They resolve the same in a clone, an editable install and an installed wheel (pip installs wheels
unpacked, so each is a real path that a compiler, a Slurm job or `cp` can use):
- reel.ops       ops/ in the repository: the Slurm job template, redis.conf, Prometheus and Grafana configs
- reel.examples  examples/: run configs and the env packages they need (`reel example list|copy`)
- the C kernels, next to the Python that calls them (producers/sampling.c, runtime/model/forward_cached.c)
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from reel.bus.errors import ReelError

__all__ = ["examples_dir", "ops_file", "package_file"]


def package_file(package: str, *parts: str) -> Path:
    """The path of `parts` inside the installed `package` (it may not exist: callers check)."""
    found = resources.files(package)
    if not isinstance(found, Path):  # a zip import: nothing outside Python could open the file
        raise ReelError(f"{package} is installed as a zip archive ({found}); reinstall reel-rl with pip, unzipped")
    return found.joinpath(*parts)


def ops_file(*parts: str) -> Path:
    """A file of ops/ (e.g. ops_file("slurm", "reel.sbatch"))."""
    return package_file("reel.ops", *parts)


def examples_dir() -> Path:
    return package_file("reel.examples")
