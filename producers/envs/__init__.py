"""Tasks with verifiable rewards. `make_env(section, max_tokens)` builds the configured one."""

from __future__ import annotations

from producers.envs.base import Env, Prompt, StringTask
from producers.envs.reverse_text import ReverseText
from producers.envs.sort_digits import SortDigits
from producers.envs.tokenizer import CharTokenizer, HFTokenizer, Tokenizer, TokenizerError
from runtime.config import ConfigError, EnvSection

ENVS: dict[str, type[StringTask]] = {"reverse_text": ReverseText, "sort_digits": SortDigits}


def make_env(section: EnvSection, max_tokens: int | None = None, tokenizer: Tokenizer | None = None) -> Env:
    """The env named by env.name, on the character tokenizer unless `tokenizer` is given.

    Long-tail prompts (share env.long_tail) ask for max_tokens - 1 characters, so with eos the
    answer takes the whole rollout budget (rollout.max_tokens) and a synchronous step waits for
    its slowest sample; max_tokens is required only when env.long_tail > 0.
    """
    if section.name not in ENVS:
        raise ConfigError(f"env.name = {section.name!r} is unknown; use {' or '.join(ENVS)}")
    long_len = 0
    if section.long_tail > 0:
        if max_tokens is None:
            raise ValueError("make_env needs max_tokens (rollout.max_tokens) when env.long_tail > 0")
        long_len = max_tokens - 1
        if long_len < section.max_len:
            raise ConfigError(f"env.long_tail = {section.long_tail} asks for answers of rollout.max_tokens - 1 = "
                              f"{long_len} characters, fewer than env.max_len = {section.max_len}; "
                              "raise rollout.max_tokens")
    return ENVS[section.name](tokenizer or CharTokenizer(), min_len=section.min_len, max_len=section.max_len,
                              long_tail=section.long_tail, long_len=long_len)


__all__ = ["CharTokenizer", "ENVS", "Env", "HFTokenizer", "Prompt", "ReverseText", "SortDigits", "StringTask",
           "Tokenizer", "TokenizerError", "make_env"]
