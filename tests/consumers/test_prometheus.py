"""A real Prometheus (the Debian `prometheus` package, installed by ops/install_test.sh) scrapes
`reel metrics serve` with the shipped config, and every query of the Grafana dashboard returns data.

The run is a finished synthetic one read from its log (tests/consumers/test_metrics.py builds it), with every
mismatch key the trainer writes, so that no panel can be empty for want of a figure.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from test_metrics import _free_port, _step, _synthetic_run, _write_run_dir

from reel.bus.events import RunFinished
from reel.consumers.aggregates import MISMATCH_KEYS
from paths import REPO

OPS = REPO / "ops"
pytestmark = pytest.mark.slow


def _get(url: str) -> dict | str:
    with urllib.request.urlopen(url, timeout=5) as response:
        body = response.read().decode()
    return json.loads(body) if "/api/" in url else body


def _wait(what: str, ready, timeout_s: float = 60.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            result = ready()
        except OSError:
            result = None
        if result:
            return result
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


def _query(prom: str, expr: str) -> list:
    reply = _get(f"{prom}/api/v1/query?" + urllib.parse.urlencode({"query": expr}))
    assert reply["status"] == "success", reply
    return reply["data"]["result"]


def test_prometheus_scrapes_every_dashboard_query(tmp_path: Path):
    run = "promrun"
    events = _synthetic_run(run)
    finished = events.pop()
    assert isinstance(finished, RunFinished)
    everything = {key: 0.5 for key in MISMATCH_KEYS} | {"reward_mean": 0.7}
    events += [_step(run, 3, ["g9"], staleness={0: 8}, metrics=everything), finished]
    _write_run_dir(tmp_path / "run", run, events)

    # The shipped config as is, but for its target file (this test's port) and a 1 s scrape interval.
    config_dir = tmp_path / "prometheus"
    shutil.copytree(OPS / "prometheus", config_dir)
    subprocess.run(["promtool", "check", "config", str(OPS / "prometheus" / "prometheus.yml")], check=True,
                   capture_output=True)
    config = config_dir / "prometheus.yml"
    config.write_text(config.read_text().replace("scrape_interval: 5s", "scrape_interval: 1s"))
    port, prom_port = _free_port(), _free_port()
    for target in (config_dir / "targets").glob("*.json"):
        target.unlink()
    (config_dir / "targets" / "test.json").write_text(json.dumps([{"targets": [f"127.0.0.1:{port}"]}]))

    env = dict(os.environ)
    exporter = subprocess.Popen([sys.executable, "-m", "reel.runtime.launch.cli", "metrics", "serve", "--run",
                                 str(tmp_path / "run"), "--port", str(port)], env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    prometheus = subprocess.Popen(["prometheus", f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                                   f"--web.listen-address=127.0.0.1:{prom_port}"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    prom = f"http://127.0.0.1:{prom_port}"
    try:
        exposition = _wait("the exporter", lambda: _get(f"http://127.0.0.1:{port}/metrics"))
        lint = subprocess.run(["promtool", "check", "metrics"], input=exposition, capture_output=True, text=True)
        assert lint.returncode == 0, lint.stdout + lint.stderr
        assert re.search(rf'^reel_dead_letters_total{{run="{run}"}} 3\.0$', exposition, re.M)
        assert re.search(r'^reel_groups_dropped_total{reason="other",run="promrun"} 1\.0$', exposition, re.M)

        _wait("the target to be up", lambda: _query(prom, f'up{{instance="127.0.0.1:{port}"}} == 1'))
        dashboard = json.loads((OPS / "grafana" / "reel.json").read_text())
        queries = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
        assert len(queries) >= 30
        for expr in queries:
            concrete = (expr.replace("$run", run).replace("$worker", ".*")
                        .replace("$__rate_interval", "10s"))
            _wait(f"data for {concrete}", lambda: _query(prom, concrete), timeout_s=30)
        families = {m["metric"]["__name__"] for m in _query(prom, '{__name__=~"reel_.+"}')}
        assert len(families) >= 30, sorted(families)
    finally:
        for process in (prometheus, exporter):
            process.terminate()
        for process in (prometheus, exporter):
            process.wait(timeout=10)
