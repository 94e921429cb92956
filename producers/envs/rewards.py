"""Reward functions of the task adapters, and the one boundary where a user's reward can fail.

`env.options.reward` of the dataset env names one: "exact" (the extracted answer equals the ground
truth after trimming), "math_verify" (math-verify's `verify(parse(truth), parse(answer))`, so
"$\\frac{1}{2}$" and "0.5" agree), or "package.module:function" with verl's `compute_score`
signature, `function(data_source, solution_str, ground_truth, extra_info) -> float | dict` (a dict
gives its "score" key, as verl reads it).

A reward function that raises, or returns something that is not a finite number, raises
`RewardError` naming the function and the reason; the rollout worker dead-letters that group with
the reason and the run goes on (producers/rollout.py).
"""

from __future__ import annotations

import math
import numbers
import re
import threading
from collections.abc import Callable
from typing import Any

from reel.bus.errors import ReelError
from reel.producers.envs.registry import import_callable
from reel.runtime.config.keys import ConfigError

RewardFn = Callable[[str, str, str, dict[str, Any]], Any]  # verl's compute_score(data_source, solution, truth, info)
_FUNCTION = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*")


class RewardError(ReelError):
    """A reward function raised or returned something that is not a finite number."""


def exact(data_source: str, solution_str: str, ground_truth: str, extra_info: dict[str, Any] | None = None) -> float:
    return 1.0 if solution_str.strip() == str(ground_truth).strip() else 0.0


def math_verify(data_source: str, solution_str: str, ground_truth: str,
                extra_info: dict[str, Any] | None = None) -> float:
    """1.0 when math-verify finds the answer equal to the ground truth (LaTeX or plain)."""
    from math_verify import parse, verify

    # math-verify bounds its work with SIGALRM, which only the main thread may set.
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    gold = parse(_as_math(str(ground_truth)), parsing_timeout=timeout)
    answer = parse(_as_math(solution_str), parsing_timeout=timeout)
    return 1.0 if gold and answer and verify(gold, answer, timeout_seconds=timeout) else 0.0


def _as_math(text: str) -> str:
    """A bare expression ("\\frac{1}{2}", "0.5") in $...$, so math-verify's LaTeX extractor reads it."""
    return text if "$" in text or "\\boxed" in text else f"${text}$"


BUILTIN: dict[str, RewardFn] = {"exact": exact, "math_verify": math_verify}


def resolve(name: str, key: str = "env.options.reward") -> RewardFn:
    """The reward function a config names; ConfigError for an unknown name or an import failure."""
    if name in BUILTIN:
        return BUILTIN[name]
    if not _FUNCTION.fullmatch(name):
        raise ConfigError(f"{key} = {name!r} is unknown; use \"exact\", \"math_verify\" or "
                          "\"package.module:function\" (verl's compute_score signature)")
    return import_callable(key, name, name)  # type: ignore[return-value]


def as_reward(value: Any, what: str) -> float:
    """A reward value as a finite float (a verl dict gives its "score"); RewardError otherwise."""
    if isinstance(value, dict):
        if "score" not in value:
            raise RewardError(f"{what} returned a dict without a \"score\" key: {sorted(value)}")
        value = value["score"]
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise RewardError(f"{what} returned {value!r} ({type(value).__name__}), not a number")
    if not math.isfinite(float(value)):
        raise RewardError(f"{what} returned {value}, not a finite number")
    return float(value)


def score(fn: RewardFn, name: str, data_source: str, solution: str, truth: str, info: dict[str, Any]) -> float:
    """fn's reward for one answer; whatever fn raises becomes a RewardError with the reason."""
    try:
        value = fn(data_source, solution, truth, info)
    except Exception as exc:  # a user's function may raise anything; the sample is what failed
        raise RewardError(f"reward function {name!r} raised {type(exc).__name__}: {exc}") from exc
    return as_reward(value, f"reward function {name!r}")
