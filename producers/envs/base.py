"""The environment interface: seeded prompts, a verifiable reward in [0, 1], the ideal answer.

Prompt format (character tokenizer): "<bos>reverse:abcde=" and the completion "edcba<eos>"; with a
checkpoint's tokenizer the prompt is its chat template around "reverse:abcde=". A completion is
read up to its first stop token; each env documents how it scores one that never emits one (it
ran out of rollout.max_tokens).

Episodes may take several model turns. After each one the env sees the conversation so far (the
prompt, then model and env turns alternating) and answers `Continue(ids)`: tokens appended as
prompt tokens (a tool result or a user turn, never trained on), after which the model takes
another turn; or `Finish(reward)`. A single-turn env only implements `reward`.

`respond` may wait (a tool call): write it as `async def` to be awaited on the rollout worker's
event loop, or as a plain function, run on a thread pool; either way it holds up only its own
episode, and a call past rollout.tool_timeout_s is cut (producers/tool_calls.py).
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from typing import Any, ClassVar

import msgspec

from reel.runtime.config.sections import EnvSection
from reel.runtime.config.keys import ConfigError
from reel.runtime.tokenizer import Tokenizer


class Prompt(msgspec.Struct):
    text: str  # the prompt ids decoded, e.g. "<bos>reverse:abcde="
    ids: list[int]  # what the engine is given
    answer: str  # the ideal completion without eos, e.g. "edcba"
    meta: dict[str, Any]  # env, question, long_tail (msgpack-friendly; goes into Trajectory.meta)


class Continue(msgspec.Struct, frozen=True):
    """The episode goes on: `ids` (a tool result or user turn) are appended, the model answers."""

    ids: list[int]
    tool_call: bool = False  # the model turn just answered was a tool call


class Finish(msgspec.Struct, frozen=True):
    """The episode is over with this reward."""

    reward: float
    scores: dict[str, float] = {}  # the reward's parts by name (a verifiers rubric's functions); Sample.scores


Reply = Continue | Finish


class Env(ABC):
    """A task with a verifiable reward. Sampling uses only the given rng, so a seed fixes prompts."""

    name: ClassVar[str]
    tokenizer: Tokenizer
    max_turns: int = 1  # model turns an episode may take; `respond` must Finish at the last one
    counts_draws: ClassVar[bool] = False  # `draw` depends on its index (a dataset's epochs): workers recover it

    @abstractmethod
    def sample(self, rng: random.Random) -> Prompt: ...

    def draw(self, rng: random.Random, index: int, seed: int) -> Prompt:
        """The run's `index`-th training prompt (from 0, over every worker; run.seed = `seed`). An env
        that walks a finite set in epochs (counts_draws) picks by the index; others draw with `rng`."""
        return self.sample(rng)

    @abstractmethod
    def reward(self, prompt: Prompt, completion_ids: list[int]) -> float:
        """Score in [0, 1] of the sampled completion tokens."""

    def respond(self, prompt: Prompt, turns: list[list[int]]) -> Reply:
        """After model turn len(turns) // 2 + 1: `turns` alternate model, env, ..., model (the last).
        A subclass may make it a coroutine (`async def respond`) when it awaits a tool."""
        return Finish(self.reward(prompt, turns[-1]))

    def held_out(self) -> Env:
        """The env the eval role draws prompts from: held out from training where the env can (another
        dataset seed or split), else this one (its prompts then differ from training's by the eval seed)."""
        return self

    def reference(self, prompt: Prompt) -> list[int]:
        """The ideal completion ids including eos (warm-start trains on these)."""
        return self.tokenizer.encode(prompt.answer) + [self.tokenizer.eos_id]

    def demonstration(self, prompt: Prompt) -> list[list[int]]:
        """An ideal episode: turns alternating model, env, ..., model (warm-start trains on the model's)."""
        return [self.reference(prompt)]

    def completion_text(self, completion_ids: list[int]) -> tuple[str, bool]:
        """The turn's text before its first stop token (special tokens dropped), and whether it has one."""
        stops = set(self.tokenizer.stop_ids)
        end = next((i for i, t in enumerate(completion_ids) if t in stops), None)
        ids = completion_ids if end is None else completion_ids[:end]
        return self.tokenizer.decode(ids, skip_special=True), end is not None


class StringTask(Env):
    """Transform a random string: prompt "<bos>{marker}:{question}=", answer solve(question).

    Question lengths are uniform in [min_len, max_len]; with probability long_tail a prompt is
    long-tail instead, of length long_len, so some answers take the whole rollout budget.
    """

    marker: ClassVar[str]  # task word in the prompt
    alphabet: ClassVar[str]  # question characters

    tokenizer: Tokenizer
    min_len: int
    max_len: int
    long_tail: float
    long_len: int

    def __init__(self, tokenizer: Tokenizer, *, min_len: int, max_len: int, long_tail: float = 0.0,
                 long_len: int = 0) -> None:
        self.tokenizer = tokenizer
        self.min_len, self.max_len = min_len, max_len
        self.long_tail, self.long_len = long_tail, long_len

    @classmethod
    def from_section(cls, section: EnvSection, tokenizer: Tokenizer, max_tokens: int) -> StringTask:
        """The env factory (env.name = "module:Class.from_section"); no env.options.

        Long-tail prompts (share env.long_tail) ask for max_tokens - 1 characters, so with eos the
        answer takes the whole rollout budget (rollout.max_tokens) and a synchronous step waits for
        its slowest sample.
        """
        if section.options:
            raise ConfigError(f"env.options = {section.options} is not used by env {section.name!r}; remove it")
        long_len = max_tokens - 1 if section.long_tail > 0 else 0
        if section.long_tail > 0 and long_len < section.max_len:
            raise ConfigError(f"env.long_tail = {section.long_tail} asks for answers of rollout.max_tokens - 1 = "
                              f"{long_len} characters, fewer than env.max_len = {section.max_len}; "
                              "raise rollout.max_tokens")
        return cls(tokenizer, min_len=section.min_len, max_len=section.max_len, long_tail=section.long_tail,
                   long_len=long_len)

    @abstractmethod
    def solve(self, question: str) -> str: ...

    def sample(self, rng: random.Random) -> Prompt:
        long = rng.random() < self.long_tail
        length = self.long_len if long else rng.randint(self.min_len, self.max_len)
        question = "".join(rng.choices(self.alphabet, k=length))
        ids = self.tokenizer.prompt_ids(f"{self.marker}:{question}=")
        return Prompt(text=self.tokenizer.decode(ids), ids=ids, answer=self.solve(question),
                      meta={"env": self.name, "question": question, "long_tail": long})

