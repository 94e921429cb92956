"""A TCP proxy in front of the test Redis that cuts connections at chosen points (real sockets).

    cut_reply_to(b"XREADGROUP")   the next reply to a command naming these bytes is dropped with
                                  the connection (Redis executed the command; the client never
                                  hears back), like a network partition after the request
    cut_before(b"}:routing")      the next command naming these bytes never reaches Redis: the
                                  connection is cut right before it, commands before it in the
                                  same write do reach Redis

Each rule fires once. Connections not cut are forwarded byte for byte.
"""

from __future__ import annotations

import asyncio
import contextlib
import re

_COMMAND_START = re.compile(rb"\*\d+\r\n\$\d+\r\n")


class FaultProxy:
    def __init__(self, upstream_url: str):
        host_port = upstream_url.split("://", 1)[1].split("/", 1)[0]
        self.upstream_host, port = host_port.rsplit(":", 1)
        self.upstream_port = int(port)
        self.url = ""  # set by start()
        self.cuts = 0  # connections cut so far
        self._reply_rule: bytes | None = None
        self._before_rule: bytes | None = None
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task] = set()

    async def __aenter__(self) -> FaultProxy:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        self.url = f"redis://127.0.0.1:{port}/0"
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._server.close()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def cut_reply_to(self, needle: bytes) -> None:
        self._reply_rule = needle

    def cut_before(self, needle: bytes) -> None:
        self._before_rule = needle

    async def _serve(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._tasks.add(task)
        server_r, server_w = await asyncio.open_connection(self.upstream_host, self.upstream_port)
        drop_reply = asyncio.Event()  # set when the reply to the last request must be dropped
        closing = [client_w, server_w]

        async def upstream() -> None:
            while data := await client_r.read(1 << 16):
                if self._before_rule is not None and self._before_rule in data:
                    at = data.index(self._before_rule)
                    starts = [m.start() for m in _COMMAND_START.finditer(data, 0, at)]
                    self._before_rule = None
                    server_w.write(data[:starts[-1]])
                    await server_w.drain()
                    await asyncio.sleep(0.2)  # let Redis run what arrived before the cut
                    raise ConnectionResetError
                if self._reply_rule is not None and self._reply_rule in data:
                    self._reply_rule = None
                    drop_reply.set()
                server_w.write(data)
                await server_w.drain()

        async def downstream() -> None:
            while data := await server_r.read(1 << 16):
                if drop_reply.is_set():
                    raise ConnectionResetError
                client_w.write(data)
                await client_w.drain()

        try:
            pumps = [asyncio.create_task(upstream()), asyncio.create_task(downstream())]
            done, pending = await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
            for p in pending:
                p.cancel()
            if any(not p.cancelled() and isinstance(p.exception(), ConnectionResetError) for p in done):
                self.cuts += 1
        finally:
            for w in closing:
                with contextlib.suppress(Exception):
                    w.transport.abort()
            self._tasks.discard(task)
