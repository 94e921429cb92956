"""Tasks with verifiable rewards. `make_env(section, max_tokens)` builds the configured one."""

from __future__ import annotations

from reel.producers.envs import registry
from reel.producers.envs.base import Continue, Env, Finish, Prompt, Reply, StringTask
from reel.runtime.config.sections import Config, EnvSection
from reel.runtime.tokenizer import CharTokenizer, HFTokenizer, Tokenizer, TokenizerError, load_tokenizer


def make_env(section: EnvSection, max_tokens: int = 16, tokenizer: Tokenizer | None = None) -> Env:
    """The env named by env.name (registry.py), on the character tokenizer unless `tokenizer` is given."""
    return registry.make_env(section, max_tokens, tokenizer or CharTokenizer())


def env_for(config: Config) -> Env:
    """The run's env on the run's tokenizer (what rollout workers and the warm-start use)."""
    return make_env(config.env, config.rollout.max_tokens, load_tokenizer(config.model.path))


__all__ = ["CharTokenizer", "Continue", "Env", "Finish", "HFTokenizer", "Prompt", "Reply", "StringTask",
           "Tokenizer", "TokenizerError", "env_for", "make_env"]
