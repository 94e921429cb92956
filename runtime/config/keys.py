"""Config keys by name, for error messages: msgspec's decode errors turned into ones that start
with the key (`trainer.lr: expected float, got str`), list an enum's allowed values, and suggest
the nearest valid key for a misspelt one ("did you mean trainer.lr?").

Generic over the root Struct (runtime/config/run.py passes `Config`), so the schema imports this
module and not the other way round.
"""

from __future__ import annotations

import difflib
import re
from typing import Literal, get_args, get_origin

import msgspec

from reel.bus.errors import ReelError


class ConfigError(ReelError, ValueError):
    """A config the user must fix; the message is one sentence naming the key."""


def require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def name_key(message: str, root: type) -> str:
    """Turn msgspec's `... - at `$.trainer.lr`` (decoding into the Struct `root`) into a message that
    starts with the key."""
    match = re.search(r"- at `\$\.([^`]+)`", message)
    what = message.split(" - at ")[0]
    where = match.group(1) if match else ""
    if "Object contains unknown field" in message:
        field = re.search(r"unknown field `([^`]+)`", message)
        unknown = field.group(1) if field else "?"
        key = f"{where}.{unknown}" if where else unknown
        return f"unknown key {key}; {_suggest(root, where, unknown)}"
    if match:
        kind = _field_type(root, where)
        if get_origin(kind) is Literal:
            choices = get_args(kind)
            return f"{where}: {what[0].lower()}{what[1:]}; use one of {', '.join(map(repr, choices))}"
        return f"{where}: {what[0].lower()}{what[1:]}"
    return what


def _keys(struct: type) -> dict[str, object]:
    """TOML key -> type of a Struct's fields."""
    return {f.encode_name: f.type for f in msgspec.structs.fields(struct)}


def _field_type(root: type, dotted: str) -> object:
    """The type of a config key such as `trainer.precision` (None if there is no such key)."""
    kind: object = root
    for part in dotted.split("."):
        if not (isinstance(kind, type) and issubclass(kind, msgspec.Struct)):
            return None
        kind = _keys(kind).get(part)
    return kind


def _suggest(root: type, section: str, unknown: str) -> str:
    """"did you mean trainer.lr?" from the keys of the same section, else the same key in another."""
    kind = _field_type(root, section) if section else root
    close = difflib.get_close_matches(unknown, list(_keys(kind)), n=1, cutoff=0.6)
    if close:
        return f"did you mean {section + '.' if section else ''}{close[0]}?"
    if section:
        elsewhere = [f"{name}.{unknown}" for name, sub in _keys(root).items() if unknown in _keys(sub)]
        if elsewhere:
            return f"did you mean {elsewhere[0]}?"
    return "remove it or check its spelling"
