"""`--set section.key=value`: change one config key from the command line (run, retrain, simulate).

The value is read as a TOML value (`--set trainer.lr=3e-4`, `--set run.name=exp2`: a bare word that
is not TOML is taken as a string). Overrides are merged into the config's TOML, so what a run
records in its config.toml is the config it ran with, overrides included.
"""

from __future__ import annotations

import tomllib
from typing import Any

import tomli_w

from reel.runtime.config.keys import ConfigError
from reel.runtime.config.sections import RunSection

__all__ = ["parse_sets", "apply_sets", "with_sets", "load_with_sets"]


def parse_sets(items: list[str] | None) -> dict[str, dict[str, Any]]:
    """["trainer.lr=3e-4", ...] -> {"trainer": {"lr": 0.0003}}; a malformed item is a ConfigError naming it."""
    out: dict[str, dict[str, Any]] = {}
    for item in items or []:
        key, sep, text = item.partition("=")
        section, dot, name = key.strip().partition(".")
        if not sep or not dot or not section or not name or "." in name:
            raise ConfigError(f"--set {item!r} must be section.key=value, e.g. --set trainer.lr=3e-4")
        out.setdefault(section, {})[name] = _value(text.strip())
    return out


def apply_sets(raw: dict[str, Any], sets: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """`raw` (parsed TOML) with the overrides merged in, key by key."""
    merged = {section: dict(keys) if isinstance(keys, dict) else keys for section, keys in raw.items()}
    for section, keys in sets.items():
        table = merged.setdefault(section, {})
        if not isinstance(table, dict):
            raise ConfigError(f"--set {section}.*: {section} is not a [section] of the config")
        table.update(keys)
    return merged


def with_sets(text: str, items: list[str] | None, source: str) -> str:
    """The TOML text of a config with `--set` items applied (unchanged when there are none)."""
    sets = parse_sets(items)
    if not sets:
        return text
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{source} is not valid TOML: {exc}") from exc
    return tomli_w.dumps(apply_sets(raw, sets))


def _value(text: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text  # a bare word: a string (run.name=exp2, env.name=arith)


def load_with_sets(path: str, items: list[str] | None, *, allow_empty: bool = False) -> tuple[Any, str]:
    """(Config, its TOML text) of the file at `path` with `--set` items applied.

    An empty file is refused unless `allow_empty` (`--defaults`): every key would silently take its
    default, a 10-step run named "run"."""
    from reel.runtime.config import run as config_mod

    try:
        text = open(path).read()
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from exc
    text = with_sets(text, items, path)
    try:
        empty = not tomllib.loads(text)
    except tomllib.TOMLDecodeError:
        empty = False  # loads() below names the TOML error
    if empty and not allow_empty:
        raise ConfigError(f"{path} sets no key, so every key would take its default (a {RunSection().steps}-"
                          f"step run named {RunSection().name!r}); write the keys of your run "
                          f"(`reel init` writes a starting config) or pass --defaults to run the defaults")
    return config_mod.loads(text, source=path), text
