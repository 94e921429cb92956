"""slow_calc: calc_tool whose calculator answers after a heavy-tailed wall time, as real tools do.

The task, prompts, reward and demonstrations are calc_tool's (producers/envs/calc_tool.py). Each
tool call waits, without using a CPU, for a delay drawn from a log-normal distribution (median
`tool_median_s`, shape `tool_sigma`, capped at `tool_max_s`): with the defaults, median 50 ms,
mean about 0.11 s, one call in a hundred over 1 s, none over 2 s; like a sandbox, a search API or
a code runner, most calls are quick and a few hold their episode for seconds. `respond` is a
coroutine, so a waiting call holds up only its own episode (producers/tool_calls.py).

The delay is a pure function of (`tool_seed`, the question, the call's turn, the call's text): the
same run waits the same, and a replayed step never calls the tool at all, since the trajectory
holds the tool's answers as env tokens.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
from statistics import NormalDist

from reel.producers.envs.base import Continue, Prompt, Reply
from reel.producers.envs.calc_tool import CalcTool
from reel.runtime.config.keys import ConfigError
from reel.runtime.config.sections import EnvSection
from reel.runtime.tokenizer import Tokenizer

_NORMAL = NormalDist()


class ToolLatency:
    """Seeded heavy-tailed delays: log-normal, capped."""

    median_s: float
    sigma: float
    max_s: float
    seed: int

    def __init__(self, median_s: float, sigma: float, max_s: float, seed: int):
        self.median_s, self.sigma, self.max_s, self.seed = median_s, sigma, max_s, seed

    def delay(self, key: str) -> float:
        """Seconds the call named by `key` waits."""
        digest = hashlib.sha256(f"reel-tool-latency:{self.seed}:{key}".encode()).digest()
        uniform = (int.from_bytes(digest[:8], "little") + 0.5) / 2**64  # in (0, 1)
        return min(self.max_s, self.median_s * math.exp(self.sigma * _NORMAL.inv_cdf(uniform)))


class SlowCalc(CalcTool):
    name = "slow_calc"

    latency: ToolLatency

    def __init__(self, tokenizer: Tokenizer, *, tool_median_s: float = 0.05, tool_sigma: float = 1.25,
                 tool_max_s: float = 2.0, tool_seed: int = 0, **calc_options: int) -> None:
        if not 0 < tool_median_s <= tool_max_s or tool_sigma < 0:
            raise ConfigError(f"env.options tool_median_s = {tool_median_s}, tool_max_s = {tool_max_s}, "
                              f"tool_sigma = {tool_sigma} need 0 < median <= max and sigma >= 0")
        super().__init__(tokenizer, **calc_options)
        self.latency = ToolLatency(tool_median_s, tool_sigma, tool_max_s, tool_seed)

    @classmethod
    def from_section(cls, section: EnvSection, tokenizer: Tokenizer, max_tokens: int) -> SlowCalc:
        return cls(tokenizer, **section.options)

    async def respond(self, prompt: Prompt, turns: list[list[int]]) -> Reply:
        reply = self.answer(prompt, turns)
        if isinstance(reply, Continue):  # a tool call: its answer comes after the tool's wall time
            call = self.tokenizer.decode(turns[-1], skip_special=True)
            await asyncio.sleep(self.latency.delay(f"{prompt.meta['question']}:{len(turns)}:{call}"))
        return reply
