"""vLLM's token-in/token-out route, `POST /inference/v1/generate`, in front of any Reel engine.

verifiers 0.4's train client renders a chat itself and asks the engine for a completion of its token
ids on this route. Reel answers it on 127.0.0.1 with the run's key as bearer token, from the same
`Engine` its own envs use (the built-in engine, or the vLLM adapter in front of Reel's vLLM server),
so a verifiers episode's tokens are sampled exactly like a native one's. Every completion is kept
(`sampled`) under (prompt ids, completion ids): the episode's branches give back the tokens, and
the adapter joins them to what only the engine knows, the policy version spans and the routing.

    request   {"model", "token_ids": [...], "sampling_params": {"temperature", "top_p", "max_tokens",
               "seed", "stop_token_ids", "logprobs", ...}}
    response  {"request_id", "prompt_token_ids", "choices": [{"token_ids", "finish_reason",
               "logprobs": {"content": [{"token": "token_id:<id>", "logprob"}]}}]}

Seeds: the client sends the slot's seed on every call of its episode; the k-th call with seed s
samples with s + k * stride (`expect`), Reel's own rule for the turns of a group (producers/episode.py).
Also answers `GET /v1/models` (the model and its context length: the client's overlong-prompt check).
"""

from __future__ import annotations

import asyncio
import hmac
import math
import uuid
from collections import defaultdict
from dataclasses import dataclass, field

from aiohttp import web

from reel.producers.engine import Completion, Engine, EngineError, SamplingParams

Key = tuple[tuple[int, ...], tuple[int, ...]]  # (prompt ids, completion ids)


@dataclass
class GenerateRoute:
    """The route's server; `start` binds a free port on 127.0.0.1, `stop` closes it."""

    engine: Engine
    key: str  # bearer token a request must carry (the run's key)
    model: str  # the served model's name
    max_tokens: int  # completion tokens at most (rollout.max_tokens): a client cannot ask for more
    max_model_len: int  # context length reported on /v1/models
    sampled: dict[Key, list[Completion]] = field(default_factory=lambda: defaultdict(list))  # samples may repeat
    url: str = ""  # http://127.0.0.1:<port>, set by start
    _calls: dict[int, int] = field(default_factory=lambda: defaultdict(int))  # seed -> calls so far
    _stride: dict[int, int] = field(default_factory=dict)  # seed -> seed step per call
    _runner: web.AppRunner | None = None

    async def start(self) -> str:
        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/inference/v1/generate", self._generate)
        app.router.add_get("/v1/models", self._models)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = self._runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}"
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            await asyncio.shield(self._runner.cleanup())
            self._runner = None

    def expect(self, seed: int, stride: int) -> None:
        """Calls that carry `seed` sample with seed, seed + stride, seed + 2 * stride, ... in turn."""
        self._calls.pop(seed, None)
        self._stride[seed] = stride

    def take(self, prompt: list[int], completion: list[int]) -> Completion | None:
        """The completion sampled for `prompt` with these tokens, forgotten once taken."""
        same = self.sampled.get((tuple(prompt), tuple(completion)))
        return same.pop() if same else None

    def _authorized(self, request: web.Request) -> bool:
        given = request.headers.get("Authorization", "").removeprefix("Bearer ").strip()
        return hmac.compare_digest(given.encode(), self.key.encode())

    async def _models(self, request: web.Request) -> web.Response:
        if not self._authorized(request):
            return _error(401, "the run's key is required (Authorization: Bearer <key>)")
        return web.json_response({"object": "list", "data": [
            {"id": self.model, "object": "model", "max_model_len": self.max_model_len}]})

    async def _generate(self, request: web.Request) -> web.Response:
        if not self._authorized(request):
            return _error(401, "the run's key is required (Authorization: Bearer <key>)")
        try:
            body = await request.json()
            prompt = [int(t) for t in body["token_ids"]]
            params = self._params(body.get("sampling_params") or {})
        except (ValueError, KeyError, TypeError) as exc:
            return _error(400, f"bad generate request: {type(exc).__name__}: {exc}")
        try:
            (c,) = await self.engine.generate(prompt, params)
        except EngineError as exc:
            return _error(400, str(exc))
        self.sampled[(tuple(prompt), tuple(c.tokens))].append(c)
        return web.json_response({
            "request_id": body.get("request_id") or uuid.uuid4().hex,
            "prompt_token_ids": prompt,
            "choices": [{"index": 0, "token_ids": c.tokens, "finish_reason": c.finish_reason,
                         "logprobs": {"content": [{"token": f"token_id:{t}", "logprob": _finite(lp)}
                                                  for t, lp in zip(c.tokens, c.logprobs)]}}]})

    def _params(self, sp: dict) -> SamplingParams:
        seed = int(sp.get("seed") or 0)
        call = self._calls[seed]
        self._calls[seed] += 1
        params = SamplingParams(
            n=1, temperature=float(sp.get("temperature", 1.0)), top_p=float(sp.get("top_p", 1.0)),
            max_tokens=min(int(sp.get("max_tokens") or self.max_tokens), self.max_tokens),
            stop_token_ids=tuple(int(t) for t in sp.get("stop_token_ids") or ()),
            seed=seed + call * self._stride.get(seed, 1))
        params.validate()
        return params


def _finite(logprob: float) -> float | None:
    """A logprob as JSON can carry it: NaN and inf become null, which the client refuses with its reason."""
    return logprob if math.isfinite(logprob) else None


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "code": status}}, status=status)
