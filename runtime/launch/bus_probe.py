"""Whether the run's embedded Redis is gone, told apart from a pause in well under a second.

A pause (SIGSTOP, a stalled disk, a busy server) is ridden out for up to bus.ride_out_s
(bus/redis_boundary.py): connecting still succeeds, since the kernel accepts on the listening
socket, or times out. A server that has exited leaves no listener: connecting is refused at once
(or its unix socket is gone). So `reel run` stops a run whose Redis refuses connections now, not
after the ride-out bound.
"""

from __future__ import annotations

import socket
from urllib.parse import urlparse

__all__ = ["refuses"]

CONNECT_TIMEOUT_S = 0.5  # a paused server's connect may time out: that is no refusal


def refuses(url: str) -> bool:
    """Whether the Redis at `url` (unix:// or redis://) refuses connections: no server listens."""
    parsed = urlparse(url)
    try:
        if parsed.scheme == "unix":
            with socket.socket(socket.AF_UNIX) as sock:
                sock.settimeout(CONNECT_TIMEOUT_S)
                sock.connect(parsed.path)
        else:
            socket.create_connection((parsed.hostname or "127.0.0.1", parsed.port or 6379),
                                     timeout=CONNECT_TIMEOUT_S).close()
    except (ConnectionRefusedError, FileNotFoundError):
        return True
    except OSError:  # timed out, unreachable: not known to be gone
        return False
    return False
