"""The real vllm-router (the `pd` extra) as the Slurm job starts it under P/D disaggregation, in front
of two HTTP servers standing in for the prefill and decode `vllm serve` (the router is what is under
test: they record the headers it sends). vllm-router sends its own `Authorization: Bearer
$OPENAI_API_KEY`, never the client's, so the job hands it the run's key in that variable: both servers
get the key, and it is in no argv."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from reel.runtime.config import run as config
from reel.runtime.launch import vllm_args
from reel.runtime.launch import slurm_script
from reel.runtime.launch.role_process import beside_python, free_port

pytestmark = pytest.mark.slow

PD = """
[run]
name = "pd-auth"
[model]
path = "/models/moe"
[engine]
kind = "vllm"
pd_disaggregation = true
prefill_nodes = 1
decode_nodes = 1
kv_connector = "NixlConnector"
[trainer]
router_replay = false
"""
KEY = "run-key-5b1e0c"


class Recorder(BaseHTTPRequestHandler):
    """Answers like a vLLM server of a P/D pair (a completion with kv_transfer_params) and records
    each request's path and Authorization header."""

    seen: list[tuple[str, str | None]]

    def do_GET(self) -> None:
        self._answer({"object": "list", "data": [{"id": "m", "object": "model"}]})

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self._answer({"id": "cmpl-1", "object": "text_completion", "model": "m",
                      "choices": [{"index": 0, "text": "x", "finish_reason": "length"}],
                      "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
                      "kv_transfer_params": {"do_remote_prefill": True, "do_remote_decode": False,
                                             "remote_engine_id": "e", "remote_block_ids": [1],
                                             "remote_host": "127.0.0.1", "remote_port": 1}})

    def _answer(self, body: dict) -> None:
        self.seen.append((f"{self.command} {self.path}", self.headers.get("Authorization")))
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


@contextmanager
def server_on_api_port() -> Iterator[tuple[str, list]]:
    """A recording server on a loopback address of its own at vLLM's API port (the job's URL has it)."""
    for _ in range(20):
        host = f"127.0.{random.randint(1, 254)}.{random.randint(2, 254)}"
        seen: list = []
        try:
            server = ThreadingHTTPServer((host, vllm_args.API_PORT), type("R", (Recorder,), {"seen": seen}))
        except OSError:
            continue
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            yield host, seen
        finally:
            server.shutdown()
            server.server_close()
        return
    pytest.fail(f"no free loopback address with port {vllm_args.API_PORT}")


def router_command(tmp_path: Path) -> str:
    script = slurm_script.render(config.loads(PD), tmp_path / "run", slurm_script.JobOptions(gpus_per_node=1))
    line = next(x for x in script.replace("\\\n", " ").splitlines() if x.startswith("start vllm-router"))
    return line.split(" -- ", 1)[1]  # what `start` runs on the node


def test_the_p_d_router_sends_the_runs_key_to_prefill_and_decode(tmp_path: Path) -> None:
    router = beside_python("vllm-router")
    assert shutil.which(router), "vllm-router is not installed: pip install reel-rl[pd]"
    command = router_command(tmp_path)
    # The key is expanded by the shell the step runs, from VLLM_API_KEY: no argv holds it.
    assert "$VLLM_API_KEY" in command and "--api-key" not in command and "--host 127.0.0.1" in command
    port = free_port()
    with server_on_api_port() as (prefill, to_prefill), server_on_api_port() as (decode, to_decode):
        env = {**os.environ, "VLLM_ROUTER": router, "PREFILL_HEAD": prefill, "DECODE_HEAD": decode,
               "ROUTER_PORT": str(port), "VLLM_API_KEY": KEY}
        env.pop("OPENAI_API_KEY", None)
        proc = subprocess.Popen(["bash", "-c", command], env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, start_new_session=True)
        try:
            _wait_healthy(proc, f"http://127.0.0.1:{port}/health")
            request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", method="POST",
                                             data=json.dumps({"model": "m", "prompt": "x", "max_tokens": 2}).encode(),
                                             headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=30) as reply:
                assert json.load(reply)["choices"][0]["text"] == "x"
        finally:
            os.killpg(proc.pid, 15)
            proc.wait(timeout=30)
    for seen in (to_prefill, to_decode):
        assert ("POST /v1/completions", f"Bearer {KEY}") in seen, seen


def _wait_healthy(proc: subprocess.Popen, url: str) -> None:
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(url, timeout=2).close()
            return
        except OSError:
            assert proc.poll() is None, f"vllm-router exited: {proc.stderr.read().decode()[-2000:]}"
            assert time.monotonic() < deadline, "vllm-router did not answer /health within 60 s"
            time.sleep(0.3)
