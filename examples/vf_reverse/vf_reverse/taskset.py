"""The taskset: words to reverse, two reward functions."""

from __future__ import annotations

import random

import verifiers.v1 as vf


class ReverseData(vf.TaskData):
    word: str  # the word to reverse; the answer is word[::-1]
    answer: str = ""  # word[::-1]: the ideal completion (Reel's warm-start trains on it)
    tools: bool = False  # the harness offers the peek tool


class ReverseTask(vf.Task[ReverseData]):
    @vf.reward(weight=0.7)
    async def exact(self, trace: vf.Trace) -> float:
        return 1.0 if _answer(trace) == self.data.word[::-1] else 0.0

    @vf.reward(weight=0.3)
    async def overlap(self, trace: vf.Trace) -> float:
        text, answer = _answer(trace), self.data.word[::-1]
        return sum(a == b for a, b in zip(text, answer)) / max(len(answer), len(text), 1)


class ReverseConfig(vf.TasksetConfig):
    num_examples: int = 2000  # train words
    eval_examples: int = 200  # eval words, disjoint from the train words
    min_len: int = 3
    max_len: int = 6
    seed: int = 0
    split: str = "train"  # "train" | "eval"
    tools: bool = False  # offer the peek tool (multi-turn episodes)


class ReverseTaskset(vf.Taskset[ReverseTask, ReverseConfig]):
    def load(self) -> list[ReverseTask]:
        c = self.config
        rng = random.Random(c.seed)
        train = _words(rng, c.num_examples, c.min_len, c.max_len, set())
        words = train if c.split == "train" else _words(rng, c.eval_examples, c.min_len, c.max_len, set(train))
        return [ReverseTask(ReverseData(prompt=f"reverse:{w}=", word=w, answer=w[::-1], tools=c.tools), c.task)
                for w in words]


def _words(rng: random.Random, count: int, min_len: int, max_len: int, exclude: set[str]) -> list[str]:
    words, seen = [], set(exclude)
    while len(words) < count:
        word = "".join(rng.choices("abcdefghijklmnopqrstuvwxyz", k=rng.randint(min_len, max_len)))
        if word not in seen:
            seen.add(word)
            words.append(word)
    return words


def _answer(trace: vf.Trace) -> str:
    """The last assistant message's text."""
    replies = [m for m in trace.branches[-1].messages if m.role == "assistant"] if trace.branches else []
    return (vf.types.content_text(replies[-1].content) if replies else "").strip()
