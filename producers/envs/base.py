"""The environment interface: seeded prompts, a verifiable reward in [0, 1], the ideal answer.

Prompt format (character tokenizer): "<bos>reverse:abcde=" and the completion "edcba<eos>".
A completion is read up to its first eos; each env documents how it scores one that never emits
eos (it ran out of rollout.max_tokens).
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from typing import Any, ClassVar

import msgspec

from producers.envs.tokenizer import Tokenizer


class Prompt(msgspec.Struct):
    text: str  # the prompt ids decoded, e.g. "<bos>reverse:abcde="
    ids: list[int]  # what the engine is given
    answer: str  # the ideal completion without eos, e.g. "edcba"
    meta: dict[str, Any]  # env, question, long_tail (msgpack-friendly; goes into Trajectory.meta)


class Env(ABC):
    """A task with a verifiable reward. Sampling uses only the given rng, so a seed fixes prompts."""

    name: ClassVar[str]
    tokenizer: Tokenizer

    @abstractmethod
    def sample(self, rng: random.Random) -> Prompt: ...

    @abstractmethod
    def reward(self, prompt: Prompt, completion_ids: list[int]) -> float:
        """Score in [0, 1] of the sampled completion tokens."""

    def reference(self, prompt: Prompt) -> list[int]:
        """The ideal completion ids including eos (warm-start trains on these)."""
        return self.tokenizer.encode(prompt.answer) + [self.tokenizer.eos_id]

    def completion_text(self, completion_ids: list[int]) -> tuple[str, bool]:
        """The completion's text before its first eos (special tokens dropped), and whether it has one."""
        eos = self.tokenizer.eos_id
        finished = eos in completion_ids
        ids = completion_ids[:completion_ids.index(eos)] if finished else completion_ids
        return self.tokenizer.decode(ids, skip_special=True), finished


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

    @abstractmethod
    def solve(self, question: str) -> str: ...

    def sample(self, rng: random.Random) -> Prompt:
        long = rng.random() < self.long_tail
        length = self.long_len if long else rng.randint(self.min_len, self.max_len)
        question = "".join(rng.choices(self.alphabet, k=length))
        bos = [] if self.tokenizer.bos_id is None else [self.tokenizer.bos_id]
        ids = bos + self.tokenizer.encode(f"{self.marker}:{question}=")
        return Prompt(text=self.tokenizer.decode(ids), ids=ids, answer=self.solve(question),
                      meta={"env": self.name, "question": question, "long_tail": long})

