"""A verifiers 0.4 environment for tests (verifiers id "vf-fixtures"): a taskset and an in-process harness.

`kind` (a taskset config field) picks the behaviour: "single" (one model turn), "multi" (the user says
"again" after the first answer: two model turns), "exits" (the harness exits 3), "flaky" (it exits 3 on the words "abc" and "moon", one turn on the others), "slow" (the harness
sleeps past any group timeout), "nan" (the `correct` reward returns NaN), "raises" (load() raises).
Rewards: `correct` (weight 1.0: the answer is the word reversed), `short` (weight 0.5: at most 4 characters).
"""

from __future__ import annotations

import asyncio

import httpx
import verifiers.v1 as vf

WORDS = ["abc", "dog", "sun", "moon", "tree", "lamp"]


class FixData(vf.TaskData):
    word: str
    answer: str
    kind: str


class FixTask(vf.Task[FixData]):
    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        if self.data.kind == "nan":
            return float("nan")
        return 1.0 if answer_of(trace) == self.data.answer else 0.0

    @vf.reward(weight=0.5)
    async def short(self, trace: vf.Trace) -> float:
        return 1.0 if len(answer_of(trace)) <= 4 else 0.0


class FixConfig(vf.TasksetConfig):
    kind: str = "single"
    rows: int = 4


class FixTaskset(vf.Taskset[FixTask, FixConfig]):
    def load(self) -> list[FixTask]:
        if self.config.kind == "raises":
            raise FileNotFoundError("the taskset's data file words.jsonl is missing")
        return [FixTask(FixData(prompt=f"reverse:{w}=", word=w, answer=w[::-1], kind=self.config.kind), self.config.task)
                for w in WORDS[:self.config.rows]]


class FixHarness(vf.Harness[vf.HarnessConfig]):
    APPENDS_SYSTEM_PROMPT = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, **kwargs) -> vf.ProgramResult:
        if data.kind == "exits" or (data.kind == "flaky" and data.word in ("abc", "moon")):
            return vf.ProgramResult(exit_code=3, stdout="", stderr="the agent crashed")
        if data.kind == "slow":
            await asyncio.sleep(60)
        messages = [{"role": "user", "content": data.prompt}]
        url = endpoint.rstrip("/").removesuffix("/v1") + "/v1/chat/completions"
        async with httpx.AsyncClient(headers={"Authorization": f"Bearer {secret}"}, timeout=None) as http:
            for turn in range(2 if data.kind == "multi" else 1):
                if turn:
                    messages.append({"role": "user", "content": "again"})
                reply = await http.post(url, json={"model": ctx.model, "messages": messages})
                reply.raise_for_status()
                message = reply.json()["choices"][0]["message"]
                messages.append({"role": "assistant", "content": message.get("content") or ""})
        return vf.ProgramResult(exit_code=0, stdout="", stderr="")


def answer_of(trace: vf.Trace) -> str:
    replies = [m for m in trace.branches[-1].messages if m.role == "assistant"] if trace.branches else []
    return (vf.types.content_text(replies[-1].content) if replies else "").strip()


__all__ = ["FixTaskset", "FixHarness"]
