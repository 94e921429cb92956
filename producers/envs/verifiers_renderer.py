"""The chat renderer verifiers' train client uses for a Reel run: Reel's own tokenizer, Reel's turn layout.

verifiers 0.4's `TrainClient` renders each model call to token ids itself and sends them to the
engine's `/inference/v1/generate`; it takes its renderer from a process-wide pool keyed by the
renderer model name (`renderers.ElasticRendererPool`). Reel puts this renderer in that pool under
the run's own name (`install`), so the client renders exactly what Reel's native envs give the
model (`Tokenizer.prompt_ids` for the first turn, the model's tokens verbatim, `Tokenizer.turn_ids`
for each tool or user turn) and never loads a tokenizer from a hub.

Tool calls are read from a turn's text in the Hermes format most chat templates use,
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, or, for tokenizers that cannot spell
braces (the character tokenizer), as `name:value` when `name` is an offered tool (the value goes to
its first parameter). Tool specs are not rendered into the prompt: the model learns the tools it is
rewarded for using.
"""

from __future__ import annotations

import json
import re
from typing import Any

from renderers.base import ParsedResponse, ParsedToolCall, RenderedTokens, ToolCallParseStatus

from reel.runtime.tokenizer import Tokenizer

_HERMES = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.DOTALL)
_COMPACT = re.compile(r"^\s*([a-z_][a-z0-9_]*):(.*?)\s*$", re.DOTALL)
MULTIPLEX = 1 << 30  # rollouts one renderer serves: the pool never builds a second one (it would load a hub tokenizer)


class ReelRenderer:
    """A `renderers.Renderer` over a Reel `Tokenizer` (prefix-stable: a turn never re-renders earlier ones)."""

    tokenizer: Tokenizer

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer

    @property
    def is_prefix_stable(self) -> bool:
        return True

    def prompt_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        """The first turn's prompt: Reel's prompt over the system content and the first user message."""
        system = [_text(m) for m in messages if m.get("role") == "system"]
        user = next((_text(m) for m in messages if m.get("role") == "user"), "")
        return self.tokenizer.prompt_ids("\n\n".join([*system[:1], user]))

    def render(self, messages: list[dict[str, Any]], *, tools: list[dict] | None = None,
               add_generation_prompt: bool = False, **kwargs: Any) -> RenderedTokens:
        first_other = next((i for i, m in enumerate(messages) if m.get("role") not in ("system", "user")),
                           len(messages))
        ids = self.prompt_ids(messages[:first_other])
        indices, sampled = [-1] * len(ids), [False] * len(ids)
        i = first_other
        while i < len(messages):
            message = messages[i]
            if message.get("role") == "assistant":
                turn = self.tokenizer.encode(_assistant_text(message)) + [self.tokenizer.eos_id]
                ids += turn
                indices += [i] * len(turn)
                sampled += [True] * len(turn)
                i += 1
                continue
            j = i
            while j < len(messages) and messages[j].get("role") != "assistant":
                j += 1
            turn = self.env_turn(messages[i:j])
            ids += turn
            indices += [i] * len(turn)
            sampled += [False] * len(turn)
            i = j
        return RenderedTokens(token_ids=ids, message_indices=indices, sampled_mask=sampled)

    def render_ids(self, messages: list[dict[str, Any]], **kwargs: Any) -> list[int]:
        return self.render(messages, **kwargs).token_ids

    def env_turn(self, messages: list[dict[str, Any]]) -> list[int]:
        """The tokens after a model turn: the tool results (or the user's message), one turn."""
        role = "tool" if any(m.get("role") == "tool" for m in messages) else str(messages[0].get("role", "user"))
        return self.tokenizer.turn_ids(role, "\n".join(_text(m) for m in messages))

    def bridge_to_next_turn(self, previous_prompt_ids: list[int], previous_completion_ids: list[int],
                            new_messages: list[dict[str, Any]], *, tools: list[dict] | None = None,
                            **kwargs: Any) -> RenderedTokens | None:
        previous = list(previous_prompt_ids) + list(previous_completion_ids)
        added = self.env_turn(new_messages) if new_messages else []
        return RenderedTokens(token_ids=previous + added, message_indices=[-1] * len(previous) + [0] * len(added),
                              sampled_mask=[False] * (len(previous) + len(added)))

    def parse_response(self, token_ids: list[int], *, tools: list[dict] | None = None,
                       prompt_ids: list[int] | None = None) -> ParsedResponse:
        stops = set(self.tokenizer.stop_ids)
        end = next((i for i, t in enumerate(token_ids) if t in stops), len(token_ids))
        text = self.tokenizer.decode(list(token_ids[:end]), skip_special=True)
        return ParsedResponse(content=text, tool_calls=tool_calls(text, tools or []))

    def get_stop_token_ids(self) -> list[int]:
        return list(self.tokenizer.stop_ids)


def tool_calls(text: str, tools: list[dict]) -> list[ParsedToolCall]:
    """The calls in a model turn's text (module docstring); none when it is a plain answer."""
    calls = []
    for block in _HERMES.findall(text):
        try:
            call = json.loads(block)
            calls.append(ParsedToolCall(raw=block, name=str(call["name"]), arguments=call.get("arguments") or {}))
        except (json.JSONDecodeError, KeyError, TypeError):
            calls.append(ParsedToolCall(raw=block, status=ToolCallParseStatus.INVALID_JSON))
    compact = _COMPACT.match(text)
    offered = {t["function"]["name"]: t["function"] for t in tools if t.get("type") == "function"}
    if not calls and compact and compact.group(1) in offered:
        spec = offered[compact.group(1)].get("parameters") or {}
        names = list(spec.get("required") or spec.get("properties") or [])
        value: Any = compact.group(2)
        kind = (spec.get("properties") or {}).get(names[0], {}).get("type") if names else None
        if kind == "integer" and re.fullmatch(r"-?\d+", value):
            value = int(value)
        calls.append(ParsedToolCall(raw=text, name=compact.group(1), arguments={names[0]: value} if names else {}))
    return calls


def install(name: str, tokenizer: Tokenizer) -> None:
    """Put a ReelRenderer in verifiers' renderer pool under `name` (TrainClientConfig.renderer_model_name),
    with room for every rollout, so the train client renders with Reel's tokenizer."""
    from verifiers.v1.clients.train import ElasticRendererPool, RendererSlot

    pool = ElasticRendererPool(name, None, multiplex=MULTIPLEX)
    if not pool.renderers:
        pool.renderers.append(RendererSlot(ReelRenderer(tokenizer)))


def _text(message: dict[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return content or ""


def _assistant_text(message: dict[str, Any]) -> str:
    calls = message.get("tool_calls") or []
    blocks = [f"<tool_call>{json.dumps({'name': c['function']['name'], 'arguments': c['function']['arguments']})}"
              "</tool_call>" for c in calls]
    return "".join([_text(message), *blocks])
