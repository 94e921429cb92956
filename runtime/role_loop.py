"""How a role's process runs its event loop: on uvloop, until SIGTERM or SIGINT asks it to stop.

A role's `run(stop)` watches the event and returns once it is set, so a stop signal ends the role
between two units of work, not in the middle of one (what was published stays exactly once)."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


def stop_on_signals(stop: asyncio.Event, also: Callable[[], object] | None = None) -> None:
    """SIGTERM and SIGINT set `stop` (and call `also`) in the running loop."""
    def handle() -> None:
        stop.set()
        if also is not None:
            also()

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, handle)


def serve(run: Callable[[asyncio.Event], Awaitable[T]], stop: asyncio.Event | None = None) -> T:
    """`run(stop)` on uvloop until it returns; SIGTERM and SIGINT set `stop` (a new event unless given)."""
    import uvloop

    async def main() -> T:
        event = stop or asyncio.Event()
        stop_on_signals(event)
        return await run(event)

    return uvloop.run(main())
