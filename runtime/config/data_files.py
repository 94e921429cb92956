"""The files of a local dataset (`[env] name = "dataset"`, env.options.path) and their sha256.

Here, not in producers/envs/, because the trainer records the digest in RunStarted (so replay and
retrain can tell the data changed) and runtime/ never imports producers/.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from reel.runtime.config.sections import Config
from reel.runtime.config.keys import ConfigError

SUFFIXES = (".jsonl", ".parquet")


def data_files(path: str, key: str = "env.options.path") -> list[Path]:
    """The JSONL/parquet file at `path`, or those directly in the directory `path` (sorted by name)."""
    if not path:
        raise ConfigError(f"{key} is not set; name a JSONL or parquet file, or a directory of them")
    p = Path(path)
    if p.is_file():
        if p.suffix not in SUFFIXES:
            raise ConfigError(f"{key} = {path!r} is neither .jsonl nor .parquet")
        return [p]
    if p.is_dir():
        files = sorted(f for f in p.iterdir() if f.is_file() and f.suffix in SUFFIXES)
        if not files:
            raise ConfigError(f"{key} = {path!r} is a directory without .jsonl or .parquet files")
        return files
    raise ConfigError(f"{key} = {path!r} does not exist")


def files_sha256(files: list[Path]) -> str:
    """One digest over the files' names and bytes, in order."""
    digest = hashlib.sha256()
    for f in files:
        digest.update(f.name.encode() + b"\0")
        with open(f, "rb") as data:
            for block in iter(lambda: data.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


def dataset_sha256(config: Config) -> str:
    """The digest of the run's dataset files; "" when the env does not read a local dataset."""
    if config.env.name != "dataset":
        return ""
    return files_sha256(data_files(str(config.env.options.get("path", ""))))
