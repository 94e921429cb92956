"""Environments as plugins: `env.name` is a built-in name, "verifiers:<id>" (an installed verifiers
environment, producers/envs/verifiers_env.py) or "package.module:factory".

A factory is any callable `factory(section: EnvSection, tokenizer: Tokenizer, max_tokens: int) -> Env`
(max_tokens = rollout.max_tokens, one model turn's budget); the attribute path after the colon
may be dotted ("mypkg.tasks:MyEnv.from_section"). The built-in tasks are registered the same
way, so a user's env gets exactly what they get. `check_config` runs when a user's config is loaded
(by the shell, runtime/launch/), so a name that cannot be found fails before a run directory exists.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
from collections.abc import Callable

from reel.runtime.config.sections import Config, EnvSection
from reel.runtime.config.keys import ConfigError
from reel.runtime.tokenizer import Tokenizer

BUILTIN: dict[str, str] = {
    "reverse_text": "reel.producers.envs.reverse_text:ReverseText.from_section",
    "sort_digits": "reel.producers.envs.sort_digits:SortDigits.from_section",
    "arith": "reel.producers.envs.arith:Arith.from_section",
    "calc_tool": "reel.producers.envs.calc_tool:CalcTool.from_section",
    "slow_calc": "reel.producers.envs.slow_calc:SlowCalc.from_section",
    "reasoning_gym": "reel.producers.envs.reasoning_gym:ReasoningGym.from_section",
    "dataset": "reel.producers.envs.dataset:Dataset.from_section",
    "verifiers": "reel.producers.envs.verifiers_env:Verifiers.from_section",
}
# Config-load checks of the task adapters' env.options (unknown task, missing column, ...): a bad
# option fails before a run directory exists, not mid-run in a rollout worker.
OPTION_CHECKS: dict[str, str] = {
    "reasoning_gym": "reel.producers.envs.reasoning_gym:check",
    "dataset": "reel.producers.envs.dataset:check",
    "verifiers": "reel.producers.envs.verifiers_env:check",
}
VERIFIERS_PREFIX = "verifiers:"
_PLUGIN = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*")


def factory_path(name: str) -> str:
    """"module:attribute" for an env name; ConfigError for a name of neither form."""
    if name in BUILTIN:
        return BUILTIN[name]
    if name.startswith(VERIFIERS_PREFIX):  # "verifiers:<id>": the verifiers adapter, the env id after the colon
        return BUILTIN["verifiers"]
    if _PLUGIN.fullmatch(name):
        return name
    raise ConfigError(f"env.name = {name!r} is unknown; use one of {', '.join(BUILTIN)}, "
                      "\"verifiers:<id>\" for a verifiers environment or \"package.module:factory\" for your own")


def check_name(name: str) -> None:
    """The name's module can be found (not imported: that may be heavy); ConfigError otherwise."""
    module = factory_path(name).split(":")[0]
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise ConfigError(f"env.name = {name!r}: module {module!r} cannot be found; install it or add its "
                          "directory to PYTHONPATH")


def check_options(section: EnvSection) -> None:
    """env.name and, for the task adapters, env.options are usable; ConfigError otherwise."""
    check_name(section.name)
    adapter = "verifiers" if section.name.startswith(VERIFIERS_PREFIX) else section.name
    if adapter in OPTION_CHECKS:
        module, function = OPTION_CHECKS[adapter].split(":")
        getattr(importlib.import_module(module), function)(section)


def check_config(config: Config, source: str) -> None:
    """The config's env and, when it evaluates on another, eval.env are usable; ConfigError naming
    `source` (the config file) and the key otherwise."""
    try:
        check_options(config.env)
        if config.eval.every > 0 and config.eval.env is not None:
            try:
                check_options(config.eval.env)
            except ConfigError as exc:
                raise ConfigError(f"eval.{exc}") from None  # its keys are eval.env.*
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from None


def resolve(name: str) -> Callable[..., object]:
    """The factory callable of env.name (imports its module)."""
    return import_callable("env.name", name, factory_path(name))


def import_callable(key: str, name: str, path: str) -> Callable[..., object]:
    """The callable at "package.module:attr.attr" that config key `key` (set to `name`) names;
    ConfigError naming the key when it cannot be imported or is not callable."""
    module_name, attribute = path.split(":")
    try:
        target: object = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"{key} = {name!r}: cannot import {module_name!r} ({exc})") from exc
    for part in attribute.split("."):
        if not hasattr(target, part):
            raise ConfigError(f"{key} = {name!r}: {module_name!r} has no attribute {attribute!r}")
        target = getattr(target, part)
    if not callable(target):
        raise ConfigError(f"{key} = {name!r}: {attribute!r} is not callable")
    return target


def make_env(section: EnvSection, max_tokens: int, tokenizer: Tokenizer):
    """The env of env.name built by its factory; a factory rejecting env.options is a ConfigError."""
    from reel.producers.envs.base import Env

    factory = resolve(section.name)
    try:
        env = factory(section, tokenizer, max_tokens)
    except TypeError as exc:
        raise ConfigError(f"env.name = {section.name!r} rejected its settings (env.options = {section.options}): "
                          f"{exc}") from exc
    if not isinstance(env, Env):
        raise ConfigError(f"env.name = {section.name!r}: the factory returned {type(env).__name__}, not an Env")
    return env
