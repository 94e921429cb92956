"""The answer-extraction rule of the task adapters (reasoning_gym, dataset), and text folding for the
character tokenizer.

A model turn's text is read up to its first stop token (special tokens dropped). The answer is then

1. the content of the last `<answer>...</answer>` pair, trimmed (reasoning-gym's own
   `extract_answer` and its system prompt's format), else
2. the content of the last `\\boxed{...}` (braces balanced; the math datasets' format), else
3. the whole text, trimmed.

A turn that never emits a stop token (it ran out of rollout.max_tokens) still gets this answer;
the task's scorer decides (a truncated answer is rarely right).
"""

from __future__ import annotations

import re

from reel.runtime.tokenizer import CHARS

_ANSWER_TAG = re.compile(r"<answer>\s?(.*?)\s?</answer>", re.DOTALL)
_BOXED = "\\boxed{"


def extract_answer(text: str) -> str:
    """The answer in a model turn's text, by the rule of the module docstring."""
    tagged = _ANSWER_TAG.findall(text)
    if tagged:
        return tagged[-1].strip()
    boxed = _last_boxed(text)
    return (boxed if boxed is not None else text).strip()


def _last_boxed(text: str) -> str | None:
    start = text.rfind(_BOXED)
    if start < 0:
        return None
    depth, i = 1, start + len(_BOXED)
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None  # unbalanced: not a boxed answer


def fold(text: str) -> str:
    """`text` in the character tokenizer's alphabet: lower-cased, every other character a space,
    runs of spaces one (so a reasoning-gym question or answer can be a tiny model's prompt)."""
    lowered = "".join(c if c in CHARS else " " for c in text.lower())
    return re.sub(r" +", " ", lowered).strip()
