"""A Slurm pool task's watcher (runtime/launch/pool_watch.py) on real processes: a frozen (SIGSTOP) worker,
a vLLM-like HTTP server that stops answering (SIGSTOP, probed by runtime/launch/server_probe.py), and the
worker that uses that server."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from reel.runtime.heartbeat import read_beats
from reel.runtime.launch.liveness import Liveness
from reel.runtime.launch.role_process import free_port
from reel.runtime.launch.server_probe import ServerProbe

# A worker that makes progress every 0.2 s and ends 0 on SIGTERM.
WORKER = """
import signal, sys, time
from pathlib import Path
from reel.runtime.heartbeat import Heartbeat
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
beat = Heartbeat(Path(sys.argv[1]))
n = 0
while True:
    n += 1
    beat.progress("generating", f"{n} groups published")
    time.sleep(0.2)
"""

# A server that answers like vLLM: /health, and /metrics whose token count moves while a request runs.
SERVER = """
import sys, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
start = time.time()
class H(BaseHTTPRequestHandler):
    def do_GET(self):
        tokens = int((time.time() - start) * 10)
        body = {"/health": "", "/metrics": f'vllm:num_requests_running{{model_name="m"}} 1.0\\n'
                f'vllm:num_requests_waiting{{model_name="m"}} 0.0\\n'
                f'vllm:generation_tokens_total{{model_name="m"}} {tokens}.0\\n'}.get(self.path)
        self.send_response(200 if body is not None else 404)
        self.end_headers()
        self.wfile.write((body or "").encode())
    def log_message(self, *args):
        pass
ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def _run_dir(tmp_path: Path, stall_s: float = 1.0) -> Path:
    (tmp_path / "roles").mkdir()
    (tmp_path / "config.toml").write_text(f"[run]\nstall_s = {stall_s}\n")
    return tmp_path


def _watch(run_dir: Path, role: str, *command: str, probe: str | None = None) -> subprocess.Popen[str]:
    argv = [sys.executable, "-m", "reel.runtime.launch.pool_watch", "--run", str(run_dir), "--role", role,
            *(["--probe", probe] if probe else []), "--", *command]
    return subprocess.Popen(argv, stderr=subprocess.PIPE, text=True, start_new_session=True)


def _until(what: str, ok, timeout: float = 30.0) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while not ok():
        assert time.monotonic() < deadline, f"not within {timeout:.0f} s: {what}"
        time.sleep(0.1)


def _pid(run_dir: Path, role: str) -> int:
    return int((run_dir / "roles" / f"{role}.pid").read_text())


def _stop(watch: subprocess.Popen[str]) -> tuple[int, str]:
    watch.send_signal(signal.SIGTERM)
    _, err = watch.communicate(timeout=30)
    return watch.returncode, err


def test_a_frozen_worker_is_killed_and_started_again_and_the_task_goes_on(tmp_path: Path):
    run_dir = _run_dir(tmp_path)
    beat = run_dir / "roles" / "rollout-0.beat"
    watch = _watch(run_dir, "rollout-0", sys.executable, "-c", WORKER, str(beat))
    try:
        _until("the worker beats", lambda: read_beats(run_dir / "roles").get("rollout-0") is not None)
        frozen = _pid(run_dir, "rollout-0")
        os.kill(frozen, signal.SIGSTOP)
        _until("a new worker", lambda: _pid(run_dir, "rollout-0") != frozen)
        _until("the new worker beats", lambda: "rollout-0" in read_beats(run_dir / "roles"))
        assert watch.poll() is None  # the task (the Slurm step) never saw it
        _until("the frozen worker is gone", lambda: not Path(f"/proc/{frozen}").exists()
               or Path(f"/proc/{frozen}/stat").read_text().split()[2] == "Z")
    finally:
        code, err = _stop(watch)
    assert code == 0, err  # SIGTERM passed on to the worker, which ended 0: the task ends with its code
    assert "reel: rollout-0 has made no progress for " in err and "bound 1 s, run.stall_s = 1" in err
    assert err.count("reel: killed rollout-0, which had stalled, and started it again") == 1, err


def test_a_server_that_stops_answering_is_named_and_restarted_and_so_is_its_worker(tmp_path: Path):
    run_dir = _run_dir(tmp_path, stall_s=3)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = _watch(run_dir, "vllm-rollout-0", sys.executable, "-c", SERVER, str(port), probe=url)
    worker = _watch(run_dir, "rollout-0", sys.executable, "-c", WORKER, str(run_dir / "roles" / "rollout-0.beat"))
    try:
        _until("the probe writes the server's beat",
               lambda: getattr(read_beats(run_dir / "roles").get("vllm-rollout-0"), "progress_count", 0) >= 2)
        assert read_beats(run_dir / "roles")["vllm-rollout-0"].phase == "generating"
        frozen_server, first_worker = _pid(run_dir, "vllm-rollout-0"), _pid(run_dir, "rollout-0")
        os.kill(frozen_server, signal.SIGSTOP)  # accepts connections (the kernel does), answers nothing
        _until("a new server", lambda: _pid(run_dir, "vllm-rollout-0") != frozen_server)
        assert (run_dir / "roles" / "vllm-rollout-0.restarts").read_text() == "1 which had stalled"
        _until("a new worker", lambda: _pid(run_dir, "rollout-0") != first_worker)
        _until("the new server answers the probe", lambda: "vllm-rollout-0" in read_beats(run_dir / "roles"))
        assert server.poll() is None and worker.poll() is None
    finally:
        server_code, server_err = _stop(server)
        worker_code, worker_err = _stop(worker)
    assert "reel: vllm-rollout-0 has made no progress for " in server_err, server_err
    assert "reel: killed vllm-rollout-0, which had stalled, and started it again" in server_err
    assert worker_err.count("reel: killed rollout-0, whose vLLM server vllm-rollout-0 was restarted, and started it "
                            "again") == 1, worker_err
    assert worker_code == 0 and server_code == 128 + signal.SIGTERM  # the server's, as a shell says it: no TERM handler


def test_the_probe_tells_an_idle_server_from_a_wedged_one(tmp_path: Path):
    """Idle (no request): waiting, so only a frozen server ages; requests but no new token: it ages."""
    port = free_port()
    wedged = SERVER.replace("int((time.time() - start) * 10)", "7")
    idle = wedged.replace('num_requests_running{{model_name="m"}} 1.0', 'num_requests_running{{model_name="m"}} 0.0')
    assert idle != wedged != SERVER
    for script, phase, waiting in ((idle, "idle", True), (wedged, "generating", False)):
        proc = subprocess.Popen([sys.executable, "-c", script, str(port)])
        try:
            probe = ServerProbe("vllm", f"http://127.0.0.1:{port}", tmp_path)
            _until("the server answers", probe.probe)
            time.sleep(0.2)
            assert probe.probe()
            beat = read_beats(tmp_path)["vllm"]
            assert (beat.phase, beat.waiting, beat.progress_count) == (phase, waiting, 0)
        finally:
            proc.kill()
            proc.wait()
        (tmp_path / "vllm.beat").unlink()
    assert not ServerProbe("vllm", f"http://127.0.0.1:{port}", tmp_path).probe()  # refused: nothing written
    assert read_beats(tmp_path) == {}
    liveness = Liveness(tmp_path, stall_s=1)
    assert liveness.decide().restart == []  # no beat yet (a server still loading): not judged
