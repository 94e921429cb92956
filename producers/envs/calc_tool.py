"""calc_tool: add and subtract a chain of numbers, with a calculator tool the model may call.

Prompt "calc 482+3907-15=" (a user message under a chat template). In each model turn the model
either calls the calculator, "call:EXPR" (EXPR in calc_lang's grammar), or answers. A call's
result is appended as a tool message "=VALUE;" ("=error;" when EXPR is outside the grammar or
has more than `terms_per_call` numbers) and the model takes another turn. Reward 1 when the
answer, given within `max_turns` model turns and ended by a stop token, is the exact value; else 0.

The number of terms is min_terms plus a geometric tail (each extra term with probability 1/2)
up to max_terms; since one call takes at most terms_per_call numbers, long chains need several
calls, so turn counts vary per problem with a long tail. The demonstration (warm-start) chains
calls left to right: "call:a+b-c" -> "=r;" -> "call:r+d" -> ... -> "VALUE".
"""

from __future__ import annotations

import random
import re

from reel.producers.envs.base import Continue, Env, Finish, Prompt, Reply
from reel.producers.envs.calc_lang import CalcError, evaluate
from reel.runtime.config.sections import EnvSection
from reel.runtime.config.keys import ConfigError
from reel.runtime.tokenizer import Tokenizer

CALL = "call:"
_TERM = re.compile(r"[+-]?\d+")


class CalcTool(Env):
    name = "calc_tool"

    tokenizer: Tokenizer
    min_terms: int
    max_terms: int
    terms_per_call: int
    max_value: int
    max_turns: int

    def __init__(self, tokenizer: Tokenizer, *, min_terms: int = 2, max_terms: int = 6, terms_per_call: int = 3,
                 max_value: int = 999, max_turns: int = 0) -> None:
        if not 2 <= min_terms <= max_terms:
            raise ConfigError(f"env.options min_terms = {min_terms}, max_terms = {max_terms} need 2 <= min <= max")
        if terms_per_call < 2 or max_value < 10:
            raise ConfigError("env.options terms_per_call must be >= 2 and max_value >= 10")
        self.tokenizer = tokenizer
        self.min_terms, self.max_terms, self.terms_per_call = min_terms, max_terms, terms_per_call
        self.max_value = max_value
        # Default: enough turns for the longest demonstration plus one retry.
        self.max_turns = max_turns or self.calls_needed(max_terms) + 2
        if self.max_turns < self.calls_needed(max_terms) + 1:
            raise ConfigError(f"env.options max_turns = {max_turns} is too few for {max_terms} terms "
                              f"({self.calls_needed(max_terms)} calls and an answer); raise it")

    @classmethod
    def from_section(cls, section: EnvSection, tokenizer: Tokenizer, max_tokens: int) -> CalcTool:
        return cls(tokenizer, **section.options)

    def calls_needed(self, terms: int) -> int:
        """Calls of the left-to-right demonstration: the first takes terms_per_call numbers, the
        next ones the running value and terms_per_call - 1 more."""
        return 1 + max(0, -(-(terms - self.terms_per_call) // (self.terms_per_call - 1)))

    def sample(self, rng: random.Random) -> Prompt:
        terms = self.min_terms
        while terms < self.max_terms and rng.random() < 0.5:
            terms += 1
        numbers = [str(rng.randint(10, self.max_value)) for _ in range(terms)]
        question = numbers[0] + "".join(rng.choice("+-") + n for n in numbers[1:])
        ids = self.tokenizer.prompt_ids(f"calc {question}=")
        return Prompt(text=self.tokenizer.decode(ids), ids=ids, answer=str(evaluate(question)),
                      meta={"env": self.name, "question": question, "terms": terms})

    def respond(self, prompt: Prompt, turns: list[list[int]]) -> Reply:
        return self.answer(prompt, turns)

    def answer(self, prompt: Prompt, turns: list[list[int]]) -> Reply:
        """The calculator's reply to the model's last turn, at once (respond may make it wait)."""
        text, finished = self.completion_text(turns[-1])
        model_turn = len(turns) // 2 + 1
        if finished and text.startswith(CALL) and model_turn < self.max_turns:
            return Continue(self.tokenizer.turn_ids("tool", self.call(text[len(CALL):])), tool_call=True)
        return Finish(1.0 if finished and text.strip() == prompt.answer else 0.0)

    def call(self, expression: str) -> str:
        """The tool message for one call."""
        if len(_TERM.findall(expression)) > self.terms_per_call:
            return "=error;"
        try:
            return f"={evaluate(expression)};"
        except CalcError:
            return "=error;"

    def reward(self, prompt: Prompt, completion_ids: list[int]) -> float:
        """A one-turn episode: only a direct answer can score."""
        reply = self.answer(prompt, [completion_ids])
        return reply.reward if isinstance(reply, Finish) else 0.0

    def demonstration(self, prompt: Prompt) -> list[list[int]]:
        terms = _TERM.findall(prompt.meta["question"])
        tok = self.tokenizer
        turns: list[list[int]] = []
        expression, rest = "".join(terms[:self.terms_per_call]), terms[self.terms_per_call:]
        while True:
            value = evaluate(expression)
            turns += [tok.encode(CALL + expression) + [tok.eos_id], tok.turn_ids("tool", f"={value};")]
            if not rest:
                break
            expression, rest = str(value) + "".join(rest[:self.terms_per_call - 1]), rest[self.terms_per_call - 1:]
        return [*turns, tok.encode(prompt.answer) + [tok.eos_id]]
