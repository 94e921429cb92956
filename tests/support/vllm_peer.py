"""A test peer for the vLLM HTTP engine (tests/producers/test_vllm_http.py): a real HTTP server in a thread that
records every call it receives and answers as vLLM's API documents (shared notes on the vLLM API).

It is a protocol peer, not vLLM: it samples nothing, answers every generate request with the body
`answer` builds, and holds generate requests while `release` is clear (to test cancel and close).
"""

from __future__ import annotations

import base64
import io
import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, NamedTuple
from urllib.parse import parse_qsl, urlsplit

import numpy as np

from reel.producers.vllm_http import GENERATE

L, K = 2, 2  # MoE layers and top-k of the tests' model (MoEConfig's defaults)


class Call(NamedTuple):
    method: str
    path: str
    query: dict[str, str]
    body: Any


def npy_base64(array: np.ndarray) -> str:
    buffer = io.BytesIO()
    np.save(buffer, array)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def vllm_response(prompt_len: int, tokens: list[int], logprobs: list[float], spans: list[dict] | None,
                  *, routing: bool = True, finish_reason: str = "stop", n: int = 1) -> dict:
    """A /inference/v1/generate body as vLLM documents it, n equal choices, last one first (vLLM
    lists them as they finish); routing ids are a function of the position."""
    routing_TLK = (np.arange((prompt_len + len(tokens) - 1) * L * K) % 8).reshape(-1, L, K).astype(np.uint16)
    choices = []
    for index in reversed(range(n)):
        choice: dict[str, Any] = {
            "index": index, "token_ids": tokens, "finish_reason": finish_reason,
            "logprobs": {"content": [{"token": f"token_id:{t}", "logprob": lp, "bytes": None,
                                      "top_logprobs": [{"token": f"token_id:{t}", "logprob": lp}]}
                                     for t, lp in zip(tokens, logprobs)]},
            "routed_experts": npy_base64(routing_TLK) if routing else None}
        if spans is not None:
            choice["weight_versions"] = spans
        choices.append(choice)
    return {"request_id": "generate-tokens-x", "choices": choices, "prompt_logprobs": None,
            "kv_transfer_params": None}


class Peer:
    """A test peer that speaks vLLM's HTTP protocol and records every call (see the module docstring)."""

    def __init__(self, log: list[tuple[str, Call]] | None = None, fail: dict[str, int] | None = None,
                 answer: Callable[[dict], dict] | None = None, drop: int = 0):
        self.calls: list[Call] = []
        self.drop = drop  # this many generate requests get their connection closed, no answer
        self.log = log if log is not None else []  # shared by peers: the order across servers
        self.fail = fail or {}
        self.answer = answer or (lambda body: vllm_response(len(body["token_ids"]), [4, 2], [-0.5, -0.25],
                                                            [{"version": "7", "start": 0, "end": 2}],
                                                            n=body["sampling_params"]["n"]))
        self.weight_version: str | None = None
        self.release = threading.Event()  # generate answers once set
        self.release.set()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self.server.daemon_threads = True
        self.server.peer = self  # type: ignore[attr-defined]
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()

    def respond(self, call: Call) -> tuple[int, Any]:
        self.calls.append(call)
        self.log.append((self.url, call))
        if call.path in self.fail:
            return self.fail[call.path], {"error": f"{call.path} failed"}
        if call.path == GENERATE:
            self.release.wait(10)
            return 200, self.answer(call.body)
        if call.path == "/update_weight_version":
            self.weight_version = call.body["new_version"]
            return 200, {"success": True, "new_version": self.weight_version}
        answers = {"/health": None, "/pause": {"status": "paused"}, "/resume": {"status": "resumed"},
                   "/collective_rpc": {"results": [None]}, "/inference/v1/abort_requests": None,
                   "/weight_info": {"weight_version": self.weight_version}}
        return (200, answers[call.path]) if call.path in answers else (404, {"detail": "Not Found"})

    def paths(self) -> list[str]:
        return [c.path for c in self.calls if c.path != "/health"]

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


class _Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self._answer("GET")

    def do_POST(self) -> None:
        self._answer("POST")

    def _answer(self, method: str) -> None:
        url = urlsplit(self.path)
        length = int(self.headers.get("content-length") or 0)
        body = json.loads(self.rfile.read(length)) if length else None
        peer = self.server.peer
        if url.path == GENERATE and peer.drop:
            peer.drop -= 1
            peer.calls.append(Call(method, url.path, dict(parse_qsl(url.query)), body))
            self.close_connection = True  # no status line: the client reads a closed connection
            return
        status, payload = peer.respond(Call(method, url.path, dict(parse_qsl(url.query)), body))
        data = b"" if payload is None else json.dumps(payload).encode()
        try:
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client cancelled the request and closed its connection

    def log_message(self, *args: Any) -> None:
        pass
