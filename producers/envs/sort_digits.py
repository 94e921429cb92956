"""sort_digits: sort a random digit string ascending; exact match only.

Reward 1 when the completion is exactly the sorted digits followed by eos, else 0 (a completion
without eos gets 0 even if its text is right: it did not finish).
"""

from __future__ import annotations

import string

from reel.producers.envs.base import Prompt, StringTask


class SortDigits(StringTask):
    name = "sort_digits"
    marker = "sort"
    alphabet = string.digits

    def solve(self, question: str) -> str:
        return "".join(sorted(question))

    def reward(self, prompt: Prompt, completion_ids: list[int]) -> float:
        text, finished = self.completion_text(completion_ids)
        return 1.0 if finished and text == prompt.answer else 0.0
