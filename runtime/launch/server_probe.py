"""A vLLM server's heartbeat, written from outside by a probe: the server runs no Reel loop, so a
thread beside its launcher asks it every PROBE_EVERY_S, and writes RUN_DIR/roles/<name>.beat
(runtime/heartbeat.py) from the answers:

    GET /health answers within PROBE_TIMEOUT_S, and GET /metrics shows
        tokens generated since the last probe      progress  ("generating", N tokens)
        no request running or waiting              alive, waiting (idle: its clients' stall is named)
        requests, but no new token                 alive, not waiting: a wedged engine ages
        no vLLM metrics                            alive, waiting (only a frozen server ages)
    no answer within PROBE_TIMEOUT_S (a frozen or wedged API server): nothing written, the beat ages

Nothing is written before the first answer: a server loading its model is not judged (its clients
bound that wait). runtime/launch/liveness.py then names a server whose beat stops moving, and
decides, as for a rollout worker, that it is killed and started again.
"""

from __future__ import annotations

import re
import threading
import urllib.error
import urllib.request
from pathlib import Path

from reel.runtime.heartbeat import BEAT_SUFFIX, Heartbeat

__all__ = ["ServerProbe", "PROBE_EVERY_S", "PROBE_TIMEOUT_S"]

PROBE_EVERY_S = 2.0
PROBE_TIMEOUT_S = 10.0  # a loaded CPU server answers /health in milliseconds; this is a frozen one
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # the servers are cluster-internal: no proxy
_SAMPLE = re.compile(r"^(vllm:generation_tokens_total|vllm:num_requests_running|vllm:num_requests_waiting)"
                     r"(?:\{[^}]*\})?\s+([0-9.eE+-]+)\s*$", re.M)


class ServerProbe:
    """Probes `url` in a daemon thread until stop(); beats go to roles_dir/<name>.beat."""

    def __init__(self, name: str, url: str, roles_dir: Path, key: str | None = None):
        self.name = name
        self.url = url.rstrip("/")
        self.heartbeat = Heartbeat(roles_dir / f"{name}{BEAT_SUFFIX}")
        self._headers = {"Authorization": f"Bearer {key}"} if key else {}
        self._tokens: float | None = None  # vllm:generation_tokens_total at the last answer
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"probe-{name}", daemon=True)

    def start(self) -> ServerProbe:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=PROBE_TIMEOUT_S + 1)

    def probe(self) -> bool:
        """One probe; whether the server answered (a beat was written)."""
        try:
            self._get("/health")
            metrics = self._get("/metrics")
        except (OSError, urllib.error.URLError):  # refused, reset, timed out, HTTP error (URLError is an OSError)
            return False
        samples: dict[str, float] = {}
        for metric, value in _SAMPLE.findall(metrics):
            samples[metric] = samples.get(metric, 0.0) + float(value)
        tokens = samples.get("vllm:generation_tokens_total")
        busy = samples.get("vllm:num_requests_running", 0.0) + samples.get("vllm:num_requests_waiting", 0.0)
        if tokens is not None and self._tokens is not None and tokens > self._tokens:
            self.heartbeat.progress("generating", f"{tokens:.0f} tokens")
        elif tokens is None or not busy:
            self.heartbeat.alive("serving" if tokens is None else "idle", "no request", waiting=True)
        else:
            self.heartbeat.alive("generating", f"{busy:.0f} requests, no new token since {self._tokens or 0:.0f}")
        self._tokens = tokens
        return True

    def _get(self, path: str) -> str:
        request = urllib.request.Request(self.url + path, headers=self._headers)
        with _OPENER.open(request, timeout=PROBE_TIMEOUT_S) as answer:
            return answer.read().decode(errors="replace")

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.probe()
            self._stop.wait(PROBE_EVERY_S)
