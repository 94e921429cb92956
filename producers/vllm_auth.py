"""The API key on every route of a `vllm serve` that Reel starts (`--middleware`, named by
runtime/launch/vllm_args.py).

vLLM's own `--api-key` guards only /v1, /v2, /inference and /cohere; the dev-mode routes Reel's
weight sync uses (/pause, /resume, /collective_rpc, /update_weight_version) and everything else
would stay open to anyone who reaches the port. This middleware requires `Authorization: Bearer
<VLLM_API_KEY>` on every path but /health (the readiness probe), and refuses to start without a key.
The key travels by environment (runtime/launch/vllm_key.py writes it to a 0600 file), never argv.
"""

from __future__ import annotations

import hashlib
import os
import secrets
from typing import Any

__all__ = ["RequireKey", "KEY_ENV", "OPEN_PATHS"]

KEY_ENV = "VLLM_API_KEY"
OPEN_PATHS = frozenset({"/health"})


class RequireKey:
    """Pure ASGI middleware: 401 for any request without the server's key."""

    def __init__(self, app: Any) -> None:
        key = os.environ.get(KEY_ENV, "")
        if not key:
            raise RuntimeError(f"{KEY_ENV} is not set: Reel's vLLM servers only run with an API key")
        self.app = app
        self._digest = hashlib.sha256(key.encode()).digest()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] not in ("http", "websocket") or scope["path"] in OPEN_PATHS or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        body = b'{"error": "Unauthorized"}'
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    def _authorized(self, scope: dict) -> bool:
        header = next((v for k, v in scope.get("headers", ()) if k == b"authorization"), b"")
        scheme, _, token = header.decode("latin-1").partition(" ")
        digest = hashlib.sha256(token.encode()).digest()
        return scheme.lower() == "bearer" and secrets.compare_digest(digest, self._digest)
