"""`reel example list|copy NAME [DIR]`: the run configs shipped with Reel, from the installed package.

An example is examples/NAME.toml (reel.examples once installed; runtime/package_files.py). `copy`
writes it into DIR together with any env package it needs: a folder of examples/ that its [env]
section names, as env.name's top-level module ("package.module:factory") or as a string option
(e.g. an environment id). Nothing is overwritten: a file or folder already there is an error that
names it, and nothing is written.
"""

from __future__ import annotations

import argparse
import itertools
import shutil
import tomllib
from pathlib import Path

from reel.bus.errors import ReelError
from reel.runtime.package_files import examples_dir

__all__ = ["env_packages", "examples", "main_copy", "main_list"]


def examples() -> dict[str, Path]:
    """Example name -> its config file."""
    return {path.stem: path for path in sorted(examples_dir().glob("*.toml"))}


def summary(path: Path, width: int = 100) -> str:
    """The first sentence of the config's opening comment (what the example does), at most `width` long."""
    lines = itertools.takewhile(lambda line: line.startswith("#"), path.read_text().splitlines())
    sentence = " ".join(line.lstrip("# ").strip() for line in lines).split(". ")[0]
    return sentence if len(sentence) <= width else sentence[:width - 3] + "..."


def env_packages(config: Path) -> list[Path]:
    """The folders of examples/ that `config`'s [env] section names."""
    env = tomllib.loads(config.read_text()).get("env", {})
    values = [v for v in [*env.values(), *env.get("options", {}).values()] if isinstance(v, str)]
    named = {v.split(":")[0].split(".")[0] for v in values} | {v.replace("-", "_") for v in values}
    return [d for d in sorted(config.parent.iterdir()) if d.is_dir() and d.name in named]


def main_list(args: argparse.Namespace) -> int:
    found = examples()
    width = max(map(len, found), default=0)
    for name, path in found.items():
        print(f"{name:<{width}}  {summary(path)}")
    return 0


def main_copy(args: argparse.Namespace) -> int:
    found = examples()
    if args.name not in found:
        raise ReelError(f"no example named {args.name!r}; choose one of {', '.join(found)} (`reel example list`)")
    config, target = found[args.name], Path(args.dir)
    if target.exists() and not target.is_dir():
        raise ReelError(f"{target} is a file; give a directory to copy the example into")
    packages = env_packages(config)
    for name in [config.name, *(p.name for p in packages)]:
        if (target / name).exists():
            raise ReelError(f"{target / name} already exists; remove it or copy into another directory")
    target.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(config, target / config.name)
    for package in packages:
        shutil.copytree(package, target / package.name, ignore=shutil.ignore_patterns("__pycache__"))
    print(f"reel: wrote {target / config.name}" + "".join(f" and {target / p.name}/" for p in packages))
    for package in packages:
        installable = (package / "pyproject.toml").is_file() or (package / "setup.py").is_file()
        step = f"pip install {target / package.name}" if installable else f"put {target} on PYTHONPATH"
        print(f"reel: it needs its env package: {step} before running it")
    print(f"reel: run it with `reel run {target / config.name}`")
    return 0
