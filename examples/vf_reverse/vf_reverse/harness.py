"""An in-process chat harness: the agent loop runs in the env's own process, no program to install.

Every model call goes to the rollout's interception `endpoint` with its bearer `secret` (the v1
contract); the loop ends at an answer that calls no tool, or after `max_turns` model turns. The one
tool, `peek(i)`, answers the task word's i-th letter (0-based).
"""

from __future__ import annotations

import json
import ssl

import httpx
import verifiers.v1 as vf

PEEK = {"type": "function", "function": {
    "name": "peek", "description": "the i-th letter of the word (0-based)",
    "parameters": {"type": "object", "properties": {"i": {"type": "integer"}}, "required": ["i"]}}}


# One TLS context for every episode's client (building one per client costs ~50 ms of CPU; the endpoint is http).
_TLS = ssl.create_default_context()


class ChatHarnessConfig(vf.HarnessConfig):
    max_turns: int = 3  # model turns per episode at most


class ChatHarness(vf.Harness[ChatHarnessConfig]):
    APPENDS_SYSTEM_PROMPT = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx: vf.ModelContext, trace: vf.Trace, runtime: vf.Runtime, endpoint: str, secret: str,
                     mcp_urls: dict[str, str], data: vf.TaskData, **kwargs) -> vf.ProgramResult:
        system, prompt = self.resolve_prompt(data)
        messages = ([{"role": "system", "content": system}] if system else []) + (
            [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt or []])
        tools = [PEEK] if getattr(data, "tools", False) else None
        url = endpoint.rstrip("/").removesuffix("/v1") + "/v1/chat/completions"  # the endpoint may name /v1
        async with httpx.AsyncClient(headers={"Authorization": f"Bearer {secret}"}, timeout=None, verify=_TLS) as http:
            for _ in range(self.config.max_turns):
                body = {"model": ctx.model, "messages": messages, **({"tools": tools} if tools else {})}
                reply = await http.post(url, json=body)
                if reply.status_code != 200:
                    return vf.ProgramResult(exit_code=1, stdout="", stderr=f"{url}: {reply.status_code}: {reply.text}")
                message = reply.json()["choices"][0]["message"]
                messages.append({k: v for k, v in message.items() if v is not None})
                calls = message.get("tool_calls") or []
                if not calls:
                    break
                for call in calls:
                    messages.append({"role": "tool", "tool_call_id": call["id"],
                                     "content": _peek(getattr(data, "word", ""), call["function"]["arguments"])})
        return vf.ProgramResult(exit_code=0, stdout="", stderr="")


def _peek(word: str, arguments: str) -> str:
    try:
        i = int(json.loads(arguments).get("i"))
    except (ValueError, TypeError, AttributeError):
        return "?"
    return word[i] if 0 <= i < len(word) else "?"
