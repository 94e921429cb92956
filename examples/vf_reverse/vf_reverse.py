"""vf-reverse: a verifiers SingleTurnEnv, written the way prime-rl users write theirs.

The prompt asks to reverse a random lower-case string ("reverse:abcde="); the rubric scores the
completion with two functions: `exact` (weight 0.7) and `overlap`, the share of positions already
right (weight 0.3), so a near miss still earns something. `load_environment` builds a train split
and a disjoint eval split (Reel's eval role reads get_eval_dataset()).
"""

from __future__ import annotations

import random

import verifiers as vf
from datasets import Dataset


def _rows(rng: random.Random, count: int, min_len: int, max_len: int, exclude: set[str]) -> list[dict]:
    rows, seen = [], set(exclude)
    while len(rows) < count:
        word = "".join(rng.choices("abcdefghijklmnopqrstuvwxyz", k=rng.randint(min_len, max_len)))
        if word not in seen:
            seen.add(word)
            rows.append({"question": f"reverse:{word}=", "answer": word[::-1]})
    return rows


def exact(completion, answer, **kwargs) -> float:
    return 1.0 if completion[-1].content.strip() == answer else 0.0


def overlap(completion, answer, **kwargs) -> float:
    text = completion[-1].content.strip()
    return sum(a == b for a, b in zip(text, answer)) / max(len(answer), len(text), 1)


def load_environment(num_examples: int = 2000, eval_examples: int = 200, min_len: int = 3, max_len: int = 6,
                     seed: int = 0) -> vf.SingleTurnEnv:
    rng = random.Random(seed)
    train = _rows(rng, num_examples, min_len, max_len, set())
    held_out = _rows(rng, eval_examples, min_len, max_len, {r["answer"][::-1] for r in train})
    return vf.SingleTurnEnv(dataset=Dataset.from_list(train), eval_dataset=Dataset.from_list(held_out),
                            rubric=vf.Rubric(funcs=[exact, overlap], weights=[0.7, 0.3]))
