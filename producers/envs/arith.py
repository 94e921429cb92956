"""arith: one-step arithmetic word problems with exact integer answers; one model turn.

"ann has 7 pens and gets 5 more. how many pens now?" -> "12". Three kinds (gets more, gives
away, boxes of), numbers in [1, max_value]; a subtraction never goes below zero. Reward 1 when
the last integer in the answer (read up to its stop token) is the exact value, else 0; an answer
without a stop token scores 0.
"""

from __future__ import annotations

import random
import re

from reel.producers.envs.base import Env, Prompt
from reel.runtime.config.sections import EnvSection
from reel.runtime.config.keys import ConfigError
from reel.runtime.tokenizer import Tokenizer

NAMES = ("ann", "bob", "eve", "sam", "kim", "tom", "liz", "max")
THINGS = ("pens", "apples", "coins", "books", "cards", "shells")
_INTEGER = re.compile(r"-?\d+")


class Arith(Env):
    name = "arith"

    tokenizer: Tokenizer
    max_value: int

    def __init__(self, tokenizer: Tokenizer, *, max_value: int = 20) -> None:
        if max_value < 2:
            raise ConfigError(f"env.options max_value = {max_value} must be at least 2")
        self.tokenizer = tokenizer
        self.max_value = max_value

    @classmethod
    def from_section(cls, section: EnvSection, tokenizer: Tokenizer, max_tokens: int) -> Arith:
        return cls(tokenizer, **section.options)

    def sample(self, rng: random.Random) -> Prompt:
        who, what = rng.choice(NAMES), rng.choice(THINGS)
        a, b = rng.randint(1, self.max_value), rng.randint(1, self.max_value)
        kind = rng.choice(("more", "away", "boxes"))
        if kind == "more":
            question, answer = f"{who} has {a} {what} and gets {b} more. how many {what} now?", a + b
        elif kind == "away":
            a, b = max(a, b), min(a, b)
            question, answer = f"{who} has {a} {what} and gives {b} away. how many {what} now?", a - b
        else:
            question, answer = f"{who} has {a} boxes of {b} {what}. how many {what} in all?", a * b
        ids = self.tokenizer.prompt_ids(question + " =")
        return Prompt(text=self.tokenizer.decode(ids), ids=ids, answer=str(answer),
                      meta={"env": self.name, "question": question, "kind": kind})

    def reward(self, prompt: Prompt, completion_ids: list[int]) -> float:
        text, finished = self.completion_text(completion_ids)
        numbers = _INTEGER.findall(text)
        return 1.0 if finished and numbers and numbers[-1] == prompt.answer else 0.0
