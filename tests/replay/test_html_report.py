"""`reel report`: one self-contained HTML file, rendered in a real headless Chromium (Debian
`chromium`, installed on the test path by ops/install.sh) with the network cut off."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from reel.bus.events import EvalResult, encode
from reel.bus.run_log import RunLog
from runbuilder import e2e_config

CHROMIUM = shutil.which("chromium") or "chromium"  # Debian's; ops/install.sh installs it on the test path

STEPS = 6


def _chromium(page: Path, *mode: str, cwd: Path) -> subprocess.CompletedProcess:
    """Headless Chromium on `page`; no host resolves, so anything fetched from the network fails loudly."""
    argv = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--enable-logging=stderr", "--v=0",
            "--host-resolver-rules=MAP * ~NOTFOUND", "--window-size=1360,2600", *mode, page.as_uri()]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=cwd)


def _console(result: subprocess.CompletedProcess) -> list[str]:
    return [line for line in result.stderr.splitlines() if ":CONSOLE" in line]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A short real `reel run` (every role a process), then two eval results as the eval role logs them."""
    tmp = tmp_path_factory.mktemp("report")
    run_dir = tmp / "run"
    # WorkerStats every 0.2 s: a quick run still logs the rollout throughput and idle charts' points.
    config = e2e_config(tmp / "c.toml", "reportrun", STEPS, {"rollout": {"stats_every_s": 0.2}})
    result = subprocess.run([sys.executable, "-m", "reel.runtime.launch.cli", "run", str(config), "--out", str(run_dir),
                             "--no-live"], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    with RunLog(run_dir) as log:
        last = log.stream("control").last_entry_id()
        for i, step in enumerate((3, 6)):
            event = EvalResult(run="reportrun", producer="eval", seq=i, version=step, step=step, env="reverse_text",
                               prompts=8, samples_per_prompt=4, mean_reward=0.25 * i + 0.1, pass_at_1=0.2, pass_at_k=0.5)
            log.stream("control").append_batch([(f"{last.split('-')[0]}-{int(last.split('-')[1]) + i + 1}", encode(event))])
    return run_dir


@pytest.mark.slow
def test_report_renders_in_headless_chromium_with_no_console_errors(run_dir: Path, tmp_path: Path) -> None:
    bisect = tmp_path / "bisect.json"
    bisect.write_text(json.dumps({"metric": "kl_k3", "direction": "above", "threshold": 0.01, "first_crossing": 4,
                                  "value": 0.02, "culprit_update": 3,
                                  "causes": [{"name": "staleness", "at_crossing": 0.02, "baseline": 0.001, "growth": 20.0}]}))
    page, timeline = tmp_path / "report.html", tmp_path / "timeline.png"
    result = subprocess.run([sys.executable, "-m", "reel.runtime.launch.cli", "report", "--run", str(run_dir), "-o",
                             str(page), "--bisect", str(bisect), "--timeline", str(timeline)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert timeline.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    html = page.read_text()
    # Self-contained: nothing to fetch (the SVG namespace is a name, not a request).
    assert not re.search(r"""(src|href)\s*=|<link|@import|url\(""", html)
    assert set(re.findall(r"https?://[^\s\"'<>]+", html)) <= {"http://www.w3.org/2000/svg"}
    for heading in ("Reward", "KL split", "Staleness", "Throughput and idle shares", "Timeline", "Eval results",
                    "Dropped groups", "Bisect findings", "Config"):
        assert f"<h2>{heading}" in html
    assert "culprit_update" in html and "[run]" in html
    assert f"step {STEPS} forward_backward" in html and "rollout:0 busy" in html  # the timeline's trainer and worker

    dom = _chromium(page, "--dump-dom", cwd=tmp_path)
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert _console(dom) == []
    charts = int(re.search(r'data-charts="(\d+)"', dom.stdout).group(1))
    assert charts == html.count('<svg class="chart"') and charts >= 9  # every chart laid out with its series
    shot = tmp_path / "report.png"
    assert _chromium(page, f"--screenshot={shot}", cwd=tmp_path).returncode == 0
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000


def test_the_console_check_sees_a_broken_page(tmp_path: Path) -> None:
    """The harness itself: a script error and a fetch from the network both reach the console lines."""
    page = tmp_path / "broken.html"
    page.write_text('<html><body><img src="https://cdn.example.com/x.png"><script>undefinedFn();</script></body></html>')
    lines = _console(_chromium(page, "--dump-dom", cwd=tmp_path))
    assert any("undefinedFn" in line for line in lines)


def test_a_directory_without_a_log_is_one_line(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "reel.runtime.launch.cli", "report", "--run", str(tmp_path), "-o",
                             str(tmp_path / "r.html")], capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert result.stderr.strip() == f"reel: {tmp_path / 'log' / 'steps'} does not exist; is {tmp_path} a run directory with a log?"
    assert not (tmp_path / "r.html").exists()
