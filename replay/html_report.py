"""`reel report --run DIR -o report.html`: one self-contained HTML page of a run, from its log.

Reward, the KL split (the mismatch role's MismatchSplit events; StepCommitted.metrics in older logs),
staleness, throughput and idle shares, a timeline of the trainer's phases and each rollout worker's
busy/tool-wait/idle time (replay/timeline.py; `--timeline FILE.png` also writes it as a PNG), eval
results, dropped groups, bisect findings (`--bisect FILE`, the output of `reel replay bisect --json`) and the config. Charts are
inline SVG (replay/svg_charts.py) and the styles inline CSS: the file opens with no network, so it
can be attached to a bug report or a paper's appendix. A short inline script only marks the page
as rendered (data-charts on <body>), which the browser test reads.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from html import escape
from pathlib import Path

import msgspec

from reel.bus.errors import ReelError
from reel.bus.events import (
    ConfigChanged, EvalResult, MismatchSplit, RunFinished, RunStarted, StepCommitted, WorkerStats,
)
from reel.bus.run_log import RunLog
from reel.replay import timeline
from reel.replay.svg_charts import bar_chart, line_chart

__all__ = ["ReportError", "RunFacts", "main", "read_facts", "render"]

KL_SPLIT = ("kl_k3", "numerics_k3", "drift_k3")


class ReportError(ReelError):
    """A run directory without a log, or a report or bisect file that cannot be read or written."""


class RunFacts(msgspec.Struct):
    """What the report shows, as read from the log."""

    run: str
    config_toml: str = ""
    code_version: str = ""
    init_reward: float | None = None
    finished: str | None = None
    steps: list[StepCommitted] = []
    evals: list[EvalResult] = []
    rollout_tokens_per_s: list[tuple[float, float]] = []  # (seconds since the first stats, sum over workers)
    rollout_idle: list[tuple[float, float]] = []  # (seconds since the first stats, mean idle share over workers)
    splits: dict[int, dict[str, float]] = {}  # step -> MismatchSplit.figures (or the commit's, in older logs)
    segments: list[timeline.Segment] = []  # the timeline (replay/timeline.py)


def read_facts(run_dir: Path) -> RunFacts:
    if not (run_dir / "log" / "steps").is_dir():
        raise ReportError(f"{run_dir / 'log' / 'steps'} does not exist; is {run_dir} a run directory with a log?")
    facts = RunFacts(run=run_dir.name)
    latest: dict[str, WorkerStats] = {}
    commits, stats = [], []
    with RunLog(run_dir, readonly=True) as log:
        for entry_id, event in log.events("steps"):
            if isinstance(event, StepCommitted):
                commits.append((entry_id, event))
                if "numerics_k3" in event.metrics:  # a log from before the mismatch role
                    facts.splits[event.step] = event.metrics
            elif isinstance(event, MismatchSplit):
                facts.splits[event.step] = event.figures
        facts.steps = [e for _, e in commits]
        for entry_id, event in log.events("control") if "control" in log.names() else []:
            match event:
                case RunStarted():
                    facts.run, facts.config_toml, facts.code_version = event.run, event.config_toml, event.code_version
                    facts.init_reward = event.init_reward
                case EvalResult():
                    facts.evals.append(event)
                case WorkerStats():
                    stats.append((entry_id, event))
                    latest[event.worker] = event
                    seconds = int(entry_id.split("-")[0]) / 1000  # entry ids are the bus's clock (ms)
                    facts.rollout_tokens_per_s.append((seconds, sum(w.tokens_per_s for w in latest.values())))
                    facts.rollout_idle.append((seconds, sum(w.idle_share for w in latest.values()) / len(latest)))
                case RunFinished():
                    facts.finished = event.reason
                case ConfigChanged():  # resumed: that end was not the last
                    facts.finished = None
    facts.segments = timeline.segments(commits, stats)
    if facts.rollout_tokens_per_s:
        t0 = facts.rollout_tokens_per_s[0][0]
        facts.rollout_tokens_per_s = [(t - t0, v) for t, v in facts.rollout_tokens_per_s]
        facts.rollout_idle = [(t - t0, v) for t, v in facts.rollout_idle]
    return facts


def _per_step(steps: list[StepCommitted], figure) -> list[tuple[float, float]]:
    points = ((s.step, figure(s)) for s in steps)
    return [(x, float(y)) for x, y in points if y is not None]


def _staleness_mean(s: StepCommitted) -> float | None:
    tokens = sum(s.staleness.values())
    return sum(k * n for k, n in s.staleness.items()) / tokens if tokens else None


def _idle(s: StepCommitted) -> float | None:
    total = s.timing.wait + s.timing.compute + s.timing.publish
    return s.timing.wait / total if total > 0 else None


def _table(header: list[str] | None, rows: list[list[object]]) -> str:
    head = "".join(f"<th>{escape(h)}</th>" for h in header or [])
    body = "".join("<tr>" + "".join(f"<td>{escape(_cell(c))}</td>" for c in row) + "</tr>" for row in rows)
    thead = f"<thead><tr>{head}</tr></thead>" if header else ""
    return f"<table>{thead}<tbody>{body}</tbody></table>"


def _cell(value: object) -> str:
    return f"{value:.4g}" if isinstance(value, float) else "—" if value is None else str(value)


def _section(title: str, *parts: str) -> str:
    content = "".join(p for p in parts if p) or "<p class=\"none\">Not in this run's log.</p>"
    return f"<section><h2>{escape(title)}</h2>{content}</section>"


def _summary(facts: RunFacts) -> str:
    last = facts.steps[-1] if facts.steps else None
    rows = [["run", facts.run], ["steps committed", len(facts.steps)],
            ["ended", facts.finished or "no end recorded (running, or killed)"], ["code version", facts.code_version or None],
            ["warm-start reward", facts.init_reward], ["last step reward", last.metrics.get("reward_mean") if last else None],
            ["groups trained", sum(len(s.groups) for s in facts.steps)],
            ["groups dropped", sum(len(s.dropped) for s in facts.steps)]]
    return _table(None, rows)


def _sections(facts: RunFacts, bisect: dict | None) -> list[str]:
    steps = facts.steps
    staleness = Counter()
    for s in steps:
        staleness.update(s.staleness)
    reasons = Counter(d.reason.split(":", 1)[0] for s in steps for d in s.dropped)
    evals = sorted(facts.evals, key=lambda e: e.step)
    return [
        _section("Summary", _summary(facts)),
        _section("Reward", line_chart("mean reward per step", {"reward_mean": _per_step(steps, lambda s: s.metrics.get("reward_mean"))},
                                      y_label="reward")),
        _section("KL split: numerics vs drift", line_chart(
            "KL k3 against π_old and its split (the mismatch role's, which may not split every step)",
            {k: _per_step(steps, lambda s, k=k: {**s.metrics, **facts.splits.get(s.step, {})}.get(k)) for k in KL_SPLIT},
            y_label="nats/token", log_y=True)),
        _section("Staleness",
                 line_chart("mean versions behind (token-weighted)", {"staleness_mean": _per_step(steps, _staleness_mean)},
                            y_label="versions"),
                 bar_chart("tokens by versions behind, whole run", [(str(k), float(n)) for k, n in sorted(staleness.items())],
                           x_label="versions behind", y_label="tokens")),
        _section("Throughput and idle shares",
                 line_chart("trainer tokens/s (tokens trained ÷ step wall time)", {"trainer": _per_step(
                     steps, lambda s: sum(s.staleness.values()) / max(1e-9, s.timing.wait + s.timing.compute + s.timing.publish))},
                     y_label="tokens/s"),
                 line_chart("rollout tokens/s (sum over workers)", {"rollout": facts.rollout_tokens_per_s},
                            x_label="seconds", y_label="tokens/s"),
                 line_chart("trainer idle share (waiting for groups)", {"idle": _per_step(steps, _idle)}, y_label="share"),
                 line_chart("rollout idle share (mean over workers)", {"idle": facts.rollout_idle},
                            x_label="seconds", y_label="share")),
        _section("Timeline: trainer phases and rollout workers", timeline.svg(facts.segments)),
        _section("Eval results",
                 line_chart("held-out scores", {"mean_reward": [(e.step, e.mean_reward) for e in evals],
                                                "pass@1": [(e.step, e.pass_at_1) for e in evals],
                                                "pass@k": [(e.step, e.pass_at_k) for e in evals]}, y_label="score"),
                 _table(["step", "version", "env", "prompts", "k", "mean reward", "pass@1", "pass@k"],
                        [[e.step, e.version, e.env, e.prompts, e.samples_per_prompt, e.mean_reward, e.pass_at_1,
                          e.pass_at_k] for e in evals]) if evals else ""),
        _section("Dropped groups",
                 bar_chart("groups dropped per step", [(str(s.step), float(len(s.dropped))) for s in steps],
                           x_label="step", y_label="groups") if any(s.dropped for s in steps) else
                 "<p>No group was dropped.</p>",
                 _table(["reason", "groups"], [[r, n] for r, n in reasons.most_common()]) if reasons else ""),
        _section("Bisect findings", _bisect(bisect) if bisect else
                 "<p class=\"none\">None given (<code>reel replay bisect --json</code> output, with --bisect).</p>"),
        _section("Config", f"<pre>{escape(facts.config_toml)}</pre>" if facts.config_toml else ""),
    ]


def _bisect(report: dict) -> str:
    rows = [[key, report.get(key)] for key in ("metric", "direction", "threshold", "first_crossing", "value",
                                                "culprit_update")]
    causes = [[c.get("name"), c.get("at_crossing"), c.get("baseline"), c.get("growth")] for c in report.get("causes", [])]
    return _table(None, rows) + _table(["cause (most likely first)", "at crossing", "baseline", "growth"], causes)


STYLE = """body{font:14px/1.45 system-ui,sans-serif;margin:24px auto;max-width:1340px;color:#222}
h1{font-size:22px}h2{font-size:17px;border-bottom:1px solid #ddd;padding-bottom:4px}
section{margin-bottom:20px}svg.chart{margin:4px 8px 4px 0;background:#fafafa;border:1px solid #eee}
.title{font-size:13px;font-weight:600}.tick{font-size:11px;fill:#444}.axis{stroke:#666}.grid{stroke:#e6e6e6}
table{border-collapse:collapse;margin:6px 0}td,th{border:1px solid #ddd;padding:3px 8px;text-align:left}
pre{background:#f6f6f6;padding:10px;overflow:auto;font-size:12px}.none{color:#888}"""

# Marks the page rendered: how many charts have a laid-out, non-empty box (read by the browser test).
SCRIPT = """addEventListener("load",function(){var n=0;document.querySelectorAll("svg.chart").forEach(function(s){
var b=s.getBoundingClientRect();if(b.width>0&&b.height>0&&s.querySelector(".series"))n++;});
document.body.setAttribute("data-charts",String(n));});"""


def render(facts: RunFacts, bisect: dict | None = None) -> str:
    title = f"Reel run {facts.run}"
    return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{escape(title)}</title>'
            f'<meta name="viewport" content="width=device-width, initial-scale=1"><style>{STYLE}</style></head>'
            f'<body><h1>{escape(title)}</h1>{"".join(_sections(facts, bisect))}<script>{SCRIPT}</script></body></html>\n')


def _read_bisect(path: str | None) -> dict | None:
    if path is None:
        return None
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ReportError(f"--bisect {path} cannot be read as the JSON of `reel replay bisect --json`: {exc}") from exc


def main(args: argparse.Namespace) -> int:
    facts = read_facts(Path(args.run_dir))
    page = render(facts, _read_bisect(args.bisect))
    if args.timeline is not None:
        try:
            timeline.png(facts.segments, Path(args.timeline))
        except OSError as exc:
            raise ReportError(f"cannot write {args.timeline}: {exc.strerror}") from exc
        print(f"reel: wrote the timeline to {args.timeline}")
    out = Path(args.output)
    try:
        out.write_text(page)
    except OSError as exc:
        raise ReportError(f"cannot write {out}: {exc.strerror}") from exc
    print(f"reel: wrote {out} ({len(page) // 1024} KiB, self-contained)")
    return 0
