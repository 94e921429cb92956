"""The engine interface on `vllm serve` API servers over HTTP (the Slurm job's vLLM pools).

The Slurm job exports REEL_VLLM_URL (where generate requests go: a pool's API server, or the
vllm-router in front of the prefill and decode pools) and REEL_VLLM_SERVERS (every API server).
vLLM's side of the mapping (seeds, logprobs, routing, cache salts) is producers/vllm.py's; here
is the wire:

    generate    POST {url}/inference/v1/generate, one request per group (n samples, split into
                runs of at most engine.max_batch): {request_id, token_ids, sampling_params,
                cache_salt, output_mode, stream}
                -> choices[i]: index, token_ids, logprobs.content[].logprob, routed_experts
                   (base64 of a .npy), weight_versions [{version, start, end}], finish_reason
    cancel      the request's connection closes (vLLM aborts a request whose client went away),
                then POST {server}/inference/v1/abort_requests to every server, best effort
    weights     on every server, each step on all of them before the next:
                POST /pause?mode=keep&clear_cache=false  (running requests keep their KV)
                POST /collective_rpc {method: reel_load_manifest, args: [manifest sha256]}
                    (a version published as one blob: reel_load_weights, [blob path, sha256])
                POST /update_weight_version {new_version}  (vLLM's weight_versions spans name it)
                POST /resume, always, even when a step before it failed
                The blob store must be on a filesystem the servers see (the run directory); a
                manifest version is verified before the pause (producers/vllm.py says why).

Rollout workers share the servers, so one of them (make_engine: worker 0) pushes weights; the
others wait in `update_weights` until every server reports the version (GET /weight_info).

Errors: a server that cannot be reached or answers other than 200 raises EngineError naming the
server and the endpoint (with the flag or variable to set when a 404 means one is missing);
a generate request whose connection drops before the answer is sent once more (ConnectionDropped
the second time); after `close`, unfinished requests raise EngineClosed.
"""

from __future__ import annotations

import asyncio
import os
import base64
import binascii
import io
import itertools
import logging
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import msgspec
import numpy as np

from reel.bus.blob_backends.file import BlobStore
from reel.bus.events import BlobRef
from reel.bus.weight_manifest import WeightManifest
from reel.producers.engine import Completion, EngineClosed, EngineError, SamplingParams
from reel.producers.vllm import VLLMEngineBase, cache_salt, policy_version, sampling_options
from reel.producers.vllm_auth import KEY_ENV

try:
    import httpx
except ImportError:  # huggingface_hub >= 2 brings httpx2, its fork with the same API
    try:
        import httpx2 as httpx
    except ImportError:
        httpx = None

if TYPE_CHECKING:
    import torch

__all__ = ["VLLMHTTPEngine", "Generated", "generate_body", "parse_generate_response"]

log = logging.getLogger("reel.vllm")

GENERATE = "/inference/v1/generate"
ABORT = "/inference/v1/abort_requests"
_DEV_ENDPOINTS = ("/pause", "/resume", "/collective_rpc", "/update_weight_version", "/weight_info")
_VLLM_ID_PREFIX = "generate-tokens-"  # vLLM's serving layer names a generate request this + request_id
CONNECT_TIMEOUT_S = 30.0
CONTROL_TIMEOUT_S = 1800.0  # a pause, a weight load or a wait for another worker's: big MoE blobs load for minutes
ABORT_TIMEOUT_S = 5.0
STARTUP_TIMEOUT_S = 900.0  # vLLM imports and loads for minutes (a busy CPU machine, or a big checkpoint)
HEALTH_POLL_S = 2.0
KEEPALIVE_S = 1.0  # idle connections kept at most this long (uvicorn closes them after 5 s)
VERSION_POLL_S = 0.5


class _LogprobEntry(msgspec.Struct):
    logprob: float


class _Logprobs(msgspec.Struct):
    content: list[_LogprobEntry]


class _Span(msgspec.Struct):
    version: str | int  # vLLM keeps the string /update_weight_version set: Reel's policy version
    start: int  # first completion token sampled under it
    end: int


class _Choice(msgspec.Struct):
    index: int
    token_ids: list[int]
    finish_reason: str | None = None
    logprobs: _Logprobs | None = None
    routed_experts: str | None = None  # base64 of an .npy [P + C - 1, L, K]
    weight_versions: list[_Span] | None = None


class _GenerateResponse(msgspec.Struct):
    choices: list[_Choice]


class _WeightInfo(msgspec.Struct):
    weight_version: str | int | None = None


class Generated(NamedTuple):
    """One sample as a server returned it, before the engine contract's checks."""

    tokens: list[int]
    logprobs: list[float]
    finish_reason: str | None
    routing: np.ndarray | None
    spans: list[tuple[int, int | None]]  # (first token, policy version; None: a label that is no Reel version)


def generate_body(prompt: list[int], params: SamplingParams, first: int, n: int, version: int,
                  request_id: str) -> dict[str, Any]:
    """The JSON body of the POST /inference/v1/generate for samples first .. first + n - 1,
    started under `version`."""
    return {"request_id": request_id, "token_ids": prompt,
            "sampling_params": sampling_options(params, first, n) | {"routed_experts_prompt_start": 0},
            "cache_salt": cache_salt(version), "output_mode": "tokens", "stream": False}


def parse_generate_response(data: bytes, where: str, n: int) -> list[Generated]:
    """A generate response body of `n` samples, in sample order; `where` (server and endpoint)
    goes into error messages."""
    try:
        response = msgspec.json.decode(data, type=_GenerateResponse)
    except msgspec.DecodeError as exc:
        raise EngineError(f"{where} answered a body Reel cannot read: {exc}") from exc
    choices = sorted(response.choices, key=lambda choice: choice.index)
    if [choice.index for choice in choices] != list(range(n)):
        raise EngineError(f"{where} answered choices {[c.index for c in choices]} for {n} samples")
    return [Generated(
        tokens=choice.token_ids,
        logprobs=[entry.logprob for entry in choice.logprobs.content] if choice.logprobs else [],
        finish_reason=choice.finish_reason,
        routing=None if choice.routed_experts is None else _decode_npy(choice.routed_experts, where),
        spans=[(span.start, policy_version(span.version)) for span in choice.weight_versions or ()])
        for choice in choices]


def _decode_npy(text: str, where: str) -> np.ndarray:
    try:
        return np.load(io.BytesIO(base64.b64decode(text, validate=True)), allow_pickle=False)
    except (binascii.Error, ValueError) as exc:
        raise EngineError(f"{where} answered routed_experts that are not a base64 .npy array: {exc}") from exc


def _hint(endpoint: str, status: int) -> str:
    if status not in (403, 404):  # vLLM answers 403 for the generate route without its flag, 404 elsewhere
        return ""
    if endpoint in _DEV_ENDPOINTS:
        return "; start `vllm serve` with VLLM_SERVER_DEV_MODE=1 in its environment"
    if endpoint == GENERATE:
        return "; vLLM >= 0.30 serves it only with --enable-scale-out (add it to engine.serve_args)"
    return ""


class ConnectionDropped(EngineError):
    """The server closed the connection before it answered (a keep-alive race, a restarting router)."""


class VLLMHTTPEngine(VLLMEngineBase):
    """Reel's engine contract against `vllm serve` API servers (see the module docstring)."""

    # Fixed at construction.
    url: str  # where generate requests go
    servers: list[str]  # every API server: weight updates and aborts go to each
    push_weights: bool  # this engine updates the servers; otherwise it waits until they report the version
    control_timeout_s: float
    startup_timeout_s: float  # how long start() waits for servers that are still loading (GET /health)

    def __init__(self, model_dir: str | Path, *, url: str, servers: Sequence[str] = (), max_batch: int = 64,
                 blobs: BlobStore | None = None, version: int = 0, routed_experts: bool = True,
                 push_weights: bool = True, control_timeout_s: float = CONTROL_TIMEOUT_S,
                 startup_timeout_s: float = STARTUP_TIMEOUT_S):
        if httpx is None:
            raise EngineError("the vLLM HTTP engine needs httpx; pip install httpx (vLLM's environment has it)")
        super().__init__(model_dir, max_batch=max_batch, blobs=blobs, version=version, routed_experts=routed_experts)
        self.url = url.rstrip("/")
        self.servers = [s.rstrip("/") for s in servers] or [self.url]
        self.push_weights = push_weights
        self.control_timeout_s = control_timeout_s
        self.startup_timeout_s = startup_timeout_s
        # Changed while serving.
        self._client: Any = None  # httpx.AsyncClient once started
        self._closed = False
        self._requests: set[asyncio.Future[bytes]] = set()  # generate calls in flight (close cancels them)
        self._ids = itertools.count()
        self._id_prefix = f"reel-{uuid.uuid4().hex[:12]}"  # request ids stay unique across the workers of a server

    async def start(self) -> None:
        if self._closed:
            raise EngineClosed("the vLLM HTTP engine was closed; make a new one")
        if self._client is not None:
            return
        # The servers are cluster-internal: no proxy from the environment; requests queue at the server,
        # not in the client (no connection limit).
        # Idle connections are dropped well before uvicorn's 5 s keep-alive ends them: reusing one the
        # server is closing fails the request ("Server disconnected"), which happens between steps.
        # Reel's servers require the run's API key on every route (producers/vllm_auth.py).
        key = os.environ.get(KEY_ENV)
        client = self._client = httpx.AsyncClient(
            trust_env=False, limits=httpx.Limits(max_connections=None, keepalive_expiry=KEEPALIVE_S),
            headers={"Authorization": f"Bearer {key}"} if key else None)
        try:
            await asyncio.gather(*(self._wait_healthy(s) for s in dict.fromkeys([self.url, *self.servers])))
        except BaseException:
            self._client = None  # the next start() tries again
            await client.aclose()
            raise

    async def _wait_healthy(self, server: str) -> None:
        """Until GET /health answers 200: a server loading its model refuses connections or answers 503."""
        started = time.monotonic()
        for attempt in itertools.count():
            try:
                await self._call(server, "/health", method="GET", timeout_s=CONNECT_TIMEOUT_S)
                if attempt:
                    log.info("vLLM server %s healthy after %.0f s", server, time.monotonic() - started)
                return
            except EngineClosed:
                raise
            except EngineError as exc:
                if time.monotonic() - started > self.startup_timeout_s:
                    raise EngineError(f"vLLM server {server} was not healthy after {self.startup_timeout_s:.0f} s "
                                      f"of waiting; last answer: {exc}") from exc
                if not attempt:
                    log.info("waiting for vLLM server %s to be healthy (%s)", server, exc)
            await asyncio.sleep(HEALTH_POLL_S)

    async def _samples(self, prompt: list[int], params: SamplingParams, first: int, n: int,
                       version: int) -> list[Completion]:
        try:
            data = await self._generate(prompt, params, first, n, version)
        except ConnectionDropped as exc:
            # Sent again once: the samples are seeded, so the server gives the same tokens (their
            # spans say so if the weights changed meanwhile); a server that is gone fails again.
            log.warning("%s; sending the request again", exc)
            data = await self._generate(prompt, params, first, n, version)
        outs = parse_generate_response(data, f"vLLM server {self.url}: POST {GENERATE}", n)
        return [self._completion(len(prompt), out.tokens, out.logprobs, out.finish_reason, out.routing, out.spans,
                                 version, params.seed + first + i) for i, out in enumerate(outs)]

    async def _generate(self, prompt: list[int], params: SamplingParams, first: int, n: int, version: int) -> bytes:
        """One POST of a generate request for n samples; aborted on the server when cancelled."""
        request_id = f"{self._id_prefix}-{next(self._ids)}"
        body = generate_body(prompt, params, first, n, version, request_id)
        request = asyncio.ensure_future(self._call(self.url, GENERATE, body=body, timeout_s=None))
        self._requests.add(request)
        self._running += n
        try:
            return await request
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if current is None or not current.cancelling():  # close() cancelled the request, not our caller
                raise EngineClosed("the vLLM HTTP engine closed before the request finished") from None
            await self._abort(request_id)
            raise
        finally:
            self._running -= n
            self._requests.discard(request)

    async def _abort(self, request_id: str) -> None:
        """Best effort on top of the closed connection: reaches the request behind a router too."""
        if self._closed:
            return
        body = {"request_ids": [request_id, _VLLM_ID_PREFIX + request_id]}  # ours, and vLLM's name for it
        results = await asyncio.gather(*(self._call(s, ABORT, body=body, timeout_s=ABORT_TIMEOUT_S)
                                         for s in self.servers), return_exceptions=True)
        for result in results:
            if isinstance(result, Exception):
                log.warning("could not abort request %s: %s", request_id, result)

    async def update_weights(self, weights: Mapping[str, torch.Tensor] | BlobRef | WeightManifest,
                             version: int, *, ref: BlobRef | None = None) -> None:
        await self.start()
        if not self.push_weights:
            if isinstance(weights, WeightManifest):  # what worker 0 refuses, this worker refuses too
                await self._verify(weights)  # (rather than wait for a version the servers never get)
            self.version = await self._wait_for_version(version)
            return
        method, args = await self._load_call(weights, ref)
        try:
            await self._each("/pause", params={"mode": "keep", "clear_cache": "false"})
            for answer in await self._each("/collective_rpc", body={"method": method, "args": args}):
                self._loaded(version, _rpc_results(answer))
            await self._each("/update_weight_version", body={"new_version": str(version)})
            self.version = version
        finally:
            await asyncio.shield(self._each("/resume"))

    async def _wait_for_version(self, version: int) -> int:
        """Every server's weight version once all reach `version` (the lowest of them)."""
        deadline = time.monotonic() + self.control_timeout_s
        while True:
            versions = await asyncio.gather(*(self._server_version(s) for s in self.servers))
            if min(versions) >= version:
                return min(versions)
            if time.monotonic() > deadline:
                server = self.servers[versions.index(min(versions))]
                raise EngineError(f"vLLM server {server} still reports weight version {min(versions)} after "
                                  f"{self.control_timeout_s:.0f} s of waiting for {version}; rollout worker 0 "
                                  f"pushes weights to the servers: see its log")
            await asyncio.sleep(VERSION_POLL_S)

    async def _server_version(self, server: str) -> int:
        data = await self._call(server, "/weight_info", method="GET", timeout_s=CONNECT_TIMEOUT_S)
        where = f"vLLM server {server}: GET /weight_info"
        try:
            info = msgspec.json.decode(data, type=_WeightInfo)
        except msgspec.DecodeError as exc:
            raise EngineError(f"{where} answered a body Reel cannot read: {exc}") from exc
        version = policy_version(info.weight_version)
        return -1 if version is None else version  # a fresh server says "default": no Reel version yet

    async def _each(self, endpoint: str, *, body: Any = None, params: dict[str, str] | None = None) -> list[bytes]:
        """POST `endpoint` to every server at once: their answers' bodies; the first failure is raised
        after all have answered."""
        results = await asyncio.gather(*(self._call(s, endpoint, body=body, params=params,
                                                    timeout_s=self.control_timeout_s) for s in self.servers),
                                       return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result
        return results

    async def _call(self, server: str, endpoint: str, *, body: Any = None, params: dict[str, str] | None = None,
                    method: str = "POST", timeout_s: float | None) -> bytes:
        """One request to one server (timeout_s None: no read limit); the boundary where errors become Reel's."""
        where = f"vLLM server {server}: {method} {endpoint}"
        if self._client is None:
            raise EngineClosed(f"{where}: the vLLM HTTP engine is closed")
        content = None if body is None else msgspec.json.encode(body)
        headers = None if body is None else {"content-type": "application/json"}
        try:
            response = await self._client.request(method, server + endpoint, content=content, headers=headers,
                                                  params=params,
                                                  timeout=httpx.Timeout(timeout_s, connect=CONNECT_TIMEOUT_S))
        except httpx.HTTPError as exc:
            if self._closed:
                raise EngineClosed(f"{where}: the vLLM HTTP engine closed before the request finished") from exc
            dropped = isinstance(exc, (httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError))
            raise (ConnectionDropped if dropped else EngineError)(f"{where} failed: {type(exc).__name__}: {exc}") from exc
        if response.status_code != 200:
            raise EngineError(f"{where} answered HTTP {response.status_code}: {response.text[:300]!r}"
                              f"{_hint(endpoint, response.status_code)}")
        return response.content

    async def close(self) -> None:
        self._closed = True
        for request in list(self._requests):
            request.cancel()
        await asyncio.gather(*self._requests, return_exceptions=True)
        if self._client is not None:
            client, self._client = self._client, None
            await client.aclose()


def _rpc_results(body: bytes) -> list[Any] | None:
    """The workers' return values in a /collective_rpc answer (vLLM answers an empty body for none)."""
    try:
        answer = msgspec.json.decode(body) if body else None
    except msgspec.DecodeError:
        return None
    return answer.get("results") if isinstance(answer, dict) else None
