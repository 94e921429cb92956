"""reverse_text: reverse a random lower-case letter string, with partial credit.

Reward = LCS(completion, answer) / max(len(completion), len(answer)): 1 only for the exact
reverse, lower for missing, extra or misplaced letters, 0 for an empty completion. A completion
without eos (it ran out of tokens) is scored on all its text and the score is halved, so a
truncated answer never beats a finished one.
"""

from __future__ import annotations

import string

from reel.producers.envs.base import Prompt, StringTask


class ReverseText(StringTask):
    name = "reverse_text"
    marker = "reverse"
    alphabet = string.ascii_lowercase

    def solve(self, question: str) -> str:
        return question[::-1]

    def reward(self, prompt: Prompt, completion_ids: list[int]) -> float:
        text, finished = self.completion_text(completion_ids)
        longest = max(len(text), len(prompt.answer))
        score = lcs_length(text, prompt.answer) / longest if longest else 1.0
        return score if finished else 0.5 * score


def lcs_length(a: str, b: str) -> int:
    """Length of the longest common subsequence (O(len(a)·len(b)); answers are short)."""
    prev = [0] * (len(b) + 1)
    for ca in a:
        cur = [0]
        for j, cb in enumerate(b):
            cur.append(prev[j] + 1 if ca == cb else max(prev[j + 1], cur[j]))
        prev = cur
    return prev[-1]
