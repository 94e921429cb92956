"""SIGTERM and SIGHUP stop `reel run` as Ctrl-C does.

SIGTERM is what Slurm, `timeout`, systemd and container runtimes send, SIGHUP what a closed
terminal sends. Python's default for both is to die at once, which would orphan the roles (each in
its own session, so a terminal's Ctrl-C reaches the launcher only) and the embedded Redis. Here
each raises `StopRequested`, a KeyboardInterrupt, so the one path that stops the roles and the bus
on Ctrl-C runs for all three. A second signal while stopping only says so: cutting the stop short
is what orphans processes.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["StopRequested", "stop_on_signals", "exit_code"]

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class StopRequested(KeyboardInterrupt):
    """A stop signal reached `reel run`; `signum` says which."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum
        self.name = signal.Signals(signum).name


@contextmanager
def stop_on_signals() -> Iterator[None]:
    """Inside, SIGINT, SIGTERM and SIGHUP raise StopRequested (once); the previous handlers come back after.

    Only the main thread can set handlers; elsewhere (a test calling `reel` in a thread) nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    for sig in STOP_SIGNALS:
        signal.signal(sig, _request_stop)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _request_stop(signum: int, frame: object) -> None:
    for sig in STOP_SIGNALS:
        signal.signal(sig, _already_stopping)
    raise StopRequested(signum)


def _already_stopping(signum: int, frame: object) -> None:
    print(f"reel: {signal.Signals(signum).name} received; already stopping every role and the bus",
          file=sys.stderr, flush=True)


def exit_code(interrupt: KeyboardInterrupt) -> int:
    """128 + the signal number, as a shell reports a process a signal ended (130 for a plain Ctrl-C)."""
    return 128 + (interrupt.signum if isinstance(interrupt, StopRequested) else signal.SIGINT)
