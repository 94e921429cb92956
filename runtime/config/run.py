"""A run's TOML decoded strictly into the schema (runtime/config/sections.py), then checked.

Every error a user can cause here is a `ConfigError` whose message names the key and what is
expected, e.g. "trainer.batch_groups = 64 exceeds ...; lower it or raise rollout.concurrency".
"""

from __future__ import annotations

import hashlib
import os
import tomllib
from pathlib import Path

import msgspec
import tomli_w

from reel.runtime.config.checks import validate
from reel.runtime.config.sections import Config
from reel.bus.errors import ReelError
from reel.runtime.config.keys import ConfigError, name_key

def loads(text: str, source: str = "config") -> Config:
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{source} is not valid TOML: {exc}") from exc
    return from_dict(raw, source)


def from_dict(raw: dict, source: str = "config") -> Config:
    """A config from parsed TOML (strict types, then the checks of `validate`)."""
    try:
        config = msgspec.convert(raw, Config, strict=True)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{source}: {name_key(str(exc), Config)}") from exc
    try:
        validate(config)
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from None  # cross-key errors name the file too
    return config


def load(path: str | Path) -> Config:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from exc
    return loads(text, source=str(path))


def warmup_steps(c: Config) -> int:
    """init.warmup_steps resolved: -1 means 150 for a model built from keys, 0 with model.path."""
    if c.init.warmup_steps >= 0:
        return c.init.warmup_steps
    return 0 if c.model.path else 150


def to_toml(c: Config) -> str:
    """The resolved config (defaults filled in) as TOML text that `loads` reads back to `c`."""
    return tomli_w.dumps(_without_none(msgspec.to_builtins(c)))


def _without_none(table: dict) -> dict:
    """TOML has no null: an unset optional section (eval.env) is left out, which reads back as unset."""
    return {k: _without_none(v) if isinstance(v, dict) else v for k, v in table.items() if v is not None}


def config_hash(c: Config) -> str:
    """Hash of what determines a training step's result: the seed, the model and the trainer.

    Not trainer.ranks, expert_parallel nor context_parallel: every commit records its world size, and
    a replay on another layout is a deviation to measure, not a different config."""
    trainer = msgspec.structs.asdict(c.trainer)
    for layout_key in ("ranks", "expert_parallel", "context_parallel"):
        trainer.pop(layout_key)
    for publish_key in ("weight_format", "weight_shard_mb", "weight_delta"):  # how versions are written, not what they hold
        trainer.pop(publish_key)
    keys = msgspec.json.encode([c.run.seed, c.model, trainer])
    return hashlib.sha256(keys).hexdigest()[:16]


def cache_dir(kind: str) -> Path:
    """$REEL_CACHE/KIND (default ~/.cache/reel/KIND): what Reel rebuilds when it is missing."""
    return Path(os.environ.get("REEL_CACHE", Path.home() / ".cache" / "reel")) / kind


class RunDirError(ReelError):
    """A run directory that cannot be used as asked."""


def load_run_config(run_dir: Path) -> Config:
    path = run_dir / "config.toml"
    if not path.is_file():
        raise RunDirError(f"{run_dir} is not a Reel run directory (no config.toml); pass the run's directory")
    return load(path)
