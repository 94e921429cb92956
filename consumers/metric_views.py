"""Views of a run's `Snapshot` (consumers/aggregates.py): the Prometheus collector and the
`reel top` layout. Pure: they read a snapshot and touch no bus, file or socket.

Prometheus names follow the conventions: `reel_` prefix, base units, `_total` on counters, a `run`
label on everything and a `worker` label on per-worker figures. Counters are exported from 0 (every
reason code, the dead letters of a clean run) so that rate() and alerts see them, and they never
decrease. A gauge not known yet (no step committed, a metrics key the trainer did not write) has
its family but no sample, so dashboards show a gap rather than a made-up zero.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from rich.columns import Columns
from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from reel.consumers.aggregates import MISMATCH_KEYS, Snapshot, end_of

__all__ = ["SnapshotCollector", "render"]

# (name, help, figure of a Snapshot); every metric also has a `run` label.
_GAUGES: list[tuple[str, str, Callable[[Snapshot], float | None]]] = [
    ("reel_trainer_step", "Latest committed trainer step.", lambda s: s.step),
    ("reel_policy_version", "Latest published policy version.", lambda s: s.policy_version),
    ("reel_run_finished", "1 once the run has run its last step.", lambda s: float(end_of(s.finished) == "finished")),
    ("reel_run_failed", "1 when a role failed and the run was stopped (until a resume).",
     lambda s: float(end_of(s.finished) == "failed")),
    ("reel_run_stopped", "1 when a signal stopped the run before its last step (until a resume).",
     lambda s: float(end_of(s.finished) == "stopped")),
    ("reel_reward_mean", "Mean group reward over the last K groups.", lambda s: s.reward_mean),
    ("reel_reward_p50", "Median group reward over the last K groups.", lambda s: s.reward_p50),
    ("reel_reward_p90", "90th percentile group reward over the last K groups.", lambda s: s.reward_p90),
    ("reel_reward_step_mean", "Mean reward of the latest step's batch.", lambda s: s.step_reward),
    ("reel_trainer_loss", "Loss of the latest step.", lambda s: s.loss),
    ("reel_trainer_grad_norm", "Gradient norm of the latest step.", lambda s: s.grad_norm),
    ("reel_trainer_idle_ratio", "Trainer wait / (wait + compute + publish) over recent steps.",
     lambda s: s.idle_ratio),
    ("reel_dataset_epoch", "Newest epoch (from 0) of a dataset env's training prompts.", lambda s: s.dataset_epoch),
    ("reel_staleness_mean_versions", "Token-weighted mean staleness of the latest step, in versions.",
     lambda s: s.recent_steps[-1].staleness_mean if s.recent_steps else None),
    ("reel_mismatch_split_step", "Step of the latest numerics/drift split (the mismatch role runs behind the trainer).",
     lambda s: s.split_step),
    ("reel_mismatch_split_lag_steps", "Committed steps the mismatch role was behind when it published its latest split.",
     lambda s: s.split_lag_steps),
]
# The eval role's latest EvalResult (held-out prompts; producers/evaluator.py).
_EVAL_GAUGES: list[tuple[str, str, Callable]] = [
    ("reel_eval_policy_version", "Policy version of the latest held-out evaluation.", lambda e: e.version),
    ("reel_eval_reward_mean", "Mean held-out reward of the latest evaluated version.", lambda e: e.mean_reward),
    ("reel_eval_pass_at_1", "Held-out pass@1 of the latest evaluated version.", lambda e: e.pass_at_1),
    ("reel_eval_pass_at_k", "Held-out pass@k (k = eval.samples_per_prompt) of the latest evaluated version.",
     lambda e: e.pass_at_k),
]
# metrics key written by the trainer -> (name, help)
_STEP_METRICS = {
    "kl_k1": ("reel_mismatch_kl_k1", "k1 estimator of the inference/trainer KL, latest step's sampled tokens."),
    "kl_k2": ("reel_mismatch_kl_k2", "k2 estimator of the inference/trainer KL, latest step's sampled tokens."),
    "kl_k3": ("reel_mismatch_kl_k3", "k3 estimator of the inference/trainer KL, latest step's sampled tokens."),
    "numerics_k3": ("reel_mismatch_numerics_kl_k3",
                    "k3 of KL(inference || trainer at the sampling version's weights): engine numerics only "
                    "(the latest MismatchSplit, at reel_mismatch_split_step)."),
    "drift_k3": ("reel_mismatch_drift_kl_k3",
                 "k3 of KL(sampling version || trainer before the step): policy drift from staleness "
                 "(the latest MismatchSplit, at reel_mismatch_split_step)."),
    "ratio_mean": ("reel_importance_ratio_mean", "Mean trainer/inference importance ratio."),
    "ratio_min": ("reel_importance_ratio_min", "Smallest trainer/inference importance ratio."),
    "ratio_max": ("reel_importance_ratio_max", "Largest trainer/inference importance ratio."),
    "ratio_frac_outside": ("reel_importance_ratio_frac_outside",
                           "Share of tokens whose ratio is outside the trust band."),
    "entropy": ("reel_policy_entropy", "Mean token entropy of the trainer policy."),
}
_WORKER_GAUGES: list[tuple[str, str, Callable]] = [
    ("reel_worker_tokens_per_second", "Generated tokens per second of a rollout worker.", lambda w: w.tokens_per_s),
    ("reel_worker_version_lag", "Latest published policy version minus the one in the worker's last stats.",
     lambda w: w.version_lag),
    ("reel_worker_policy_version", "Policy version a rollout worker samples with.", lambda w: w.policy_version),
    ("reel_worker_running", "Sequences a rollout worker is decoding.", lambda w: w.running),
    ("reel_worker_waiting", "Sequences queued on a rollout worker.", lambda w: w.waiting),
    ("reel_worker_idle_ratio", "Share of time a rollout worker's engine is idle.", lambda w: w.idle_share),
    ("reel_worker_version_spans_assumed", "Samples whose policy version was assumed (vLLM sent no weight_versions).",
     lambda w: w.version_spans_assumed),
]


def _family(cls: type, name: str, doc: str, run: str, values: dict, label: str | None = None):
    """A metric family with one sample per {label value: figure}; figures of None are left out."""
    family = cls(name, doc, labels=["run", label] if label else ["run"])
    for key, value in values.items():
        if value is not None:
            family.add_metric([run, str(key)] if label else [run], float(value))
    return family


class SnapshotCollector(Collector):
    """Yields the figures of whatever snapshot `current()` returns at scrape time."""

    def __init__(self, current: Callable[[], Snapshot]):
        self._current = current

    def collect(self):
        s = self._current()
        for name, doc, figure in _GAUGES:
            yield _family(GaugeMetricFamily, name, doc, s.run, {None: figure(s)})
        for key, (name, doc) in _STEP_METRICS.items():
            yield _family(GaugeMetricFamily, name, doc, s.run, {None: s.mismatch.get(key)})
        for name, doc, figure in _WORKER_GAUGES:
            yield _family(GaugeMetricFamily, name, doc, s.run, {w.worker: figure(w) for w in s.workers}, "worker")
        yield _family(CounterMetricFamily, "reel_groups_published",
                      "Trajectory groups a rollout worker put on the bus (distinct events, counted by this "
                      "exporter); published - trained - dropped = groups waiting for the trainer or left over at the end.",
                      s.run, s.groups_published, "worker")
        yield _family(CounterMetricFamily, "reel_groups_trained", "Groups in the batches of committed trainer steps.",
                      s.run, {None: s.groups_trained})
        yield _family(CounterMetricFamily, "reel_groups_dropped",
                      "Groups the trainer discarded without training, by reason code (stale: more versions "
                      "behind than trainer.max_off_policy_steps; bad_routing: its routing trace does not fit its "
                      "tokens; other); the full reason is in the steps log.",
                      s.run, s.dropped, "reason")
        yield _family(CounterMetricFamily, "reel_staleness_tokens",
                      "Completion tokens of committed batches by how many policy versions behind the trainer "
                      "they were sampled.", s.run, s.staleness, "versions_behind")
        yield _family(CounterMetricFamily, "reel_dead_letters",
                      "Bus entries ever moved to the run's dead-letter stream (undecodable, or out of "
                      "deliveries; each entry's reason is in the stream); no sample when unknown (a crashed "
                      "run's log read without its bus).", s.run, {None: s.dead_letters})
        for name, doc, figure in _EVAL_GAUGES:
            yield _family(GaugeMetricFamily, name, doc, s.run, {None: figure(s.latest_eval) if s.latest_eval else None})
        yield _family(GaugeMetricFamily, "reel_eval_task_reward_mean",
                      "Mean held-out reward per task of a mixture, latest evaluated version.", s.run,
                      s.latest_eval.per_task if s.latest_eval else {}, "task")
        yield _family(CounterMetricFamily, "reel_eval_skipped_versions",
                      "Policy versions the eval role passed over because it ran behind the trainer.", s.run,
                      {None: s.eval_skipped})
        yield _family(GaugeMetricFamily, "reel_reward_task_mean",
                      "Mean training group reward per task of a mixture over its last K groups.", s.run,
                      s.reward_by_task, "task")
        yield _family(GaugeMetricFamily, "reel_reward_part_mean",
                      "Mean of each part of the training reward (a verifiers rubric's functions, Sample.scores) "
                      "over the last K groups.", s.run, s.reward_parts, "part")
        yield _family(CounterMetricFamily, "reel_bus_lost_events",
                      "Logged events Redis lost (e.g. its last second after a crash), found when the run resumed.",
                      s.run, {None: s.bus_lost_events})


def _fmt(value: float | int | None, pct: bool = False) -> str:
    if value is None:
        return "-"
    if pct:
        return f"{100 * value:.1f}%"
    return str(value) if isinstance(value, int) else f"{value:.4g}"


def _pairs(title: str, rows: list[tuple[str, ...]]) -> Table:
    """Label, value and, for histograms, a bar."""
    table = Table(title=title, show_header=False, box=None, title_justify="left", title_style="bold")
    table.add_column(style="cyan")
    table.add_column(justify="right")
    if rows and len(rows[0]) == 3:
        table.add_column(style="blue")
    for row in rows:
        table.add_row(*row)
    return table


def _status(s: Snapshot, live: bool) -> Text:
    """finished, failed (the role and its exit code), stopped (the signal), running; a run read from
    its log without a RunFinished (or resumed since) ended with no record: killed, or a lost node."""
    end, after = end_of(s.finished), f"after step {_fmt(s.step)}"
    if end == "finished":
        return Text(f"finished: {s.finished}", "yellow")
    if end == "failed":
        return Text(f"failed {after}: {s.finished.partition(':')[2].strip()}", "bold red")
    if end == "stopped":
        return Text(f"stopped {after} by {s.finished.partition(':')[2].strip()}, not finished", "red")
    if live:
        return Text("running", "green")
    return Text(f"stopped {after}, not finished (no end recorded: killed?)", "red")


def render(s: Snapshot, where: str, *, live: bool = True) -> RenderableType:
    """`live`: the figures come from a reachable bus."""
    status = _status(s, live)
    head = Text.assemble((f"reel top  {s.run}", "bold"), f"   {where}   ", status)
    training = _pairs("training", [
        ("step", _fmt(s.step)), ("policy version", _fmt(s.policy_version)), ("loss", _fmt(s.loss)),
        ("grad norm", _fmt(s.grad_norm)), ("reward (step)", _fmt(s.step_reward)),
        (f"reward mean ({s.window_groups} groups)", _fmt(s.reward_mean)),
        ("reward p50 / p90", f"{_fmt(s.reward_p50)} / {_fmt(s.reward_p90)}"),
        ("trainer idle", _fmt(s.idle_ratio, pct=True)),
        ("groups published / trained", f"{s.groups_seen} / {s.groups_trained}"),
        ("dead letters", _fmt(s.dead_letters)),
        *([("dataset epoch", str(s.dataset_epoch))] if s.dataset_epoch is not None else []),
    ])
    mismatch = _pairs("mismatch", [(k, _fmt(s.mismatch.get(k))) for k in MISMATCH_KEYS])
    tokens = sum(s.staleness.values())
    staleness = _pairs("staleness (tokens)", [
        (f"{k} behind", str(n), "#" * round(20 * n / tokens)) for k, n in s.staleness.items()])
    dropped = _pairs("dropped groups", [(reason, str(n)) for reason, n in s.dropped.items()])
    workers = Table(title="rollout workers", title_justify="left", title_style="bold", box=None)
    for column in ("worker", "tokens/s", "running", "waiting", "version", "lag", "groups", "idle"):
        workers.add_column(column, justify="left" if column == "worker" else "right")
    for w in s.workers:
        workers.add_row(w.worker, f"{w.tokens_per_s:.1f}", str(w.running), str(w.waiting), str(w.policy_version),
                        _fmt(w.version_lag), str(s.groups_published.get(w.worker, 0)), _fmt(w.idle_share, pct=True))
    steps = Table(title="recent steps", title_justify="left", title_style="bold", box=None)
    for column in ("step", "loss", "reward", "kl_k3", "numerics", "drift", "ratio max", "staleness", "idle",
                   "dropped"):
        steps.add_column(column, justify="right")
    for r in s.recent_steps[-8:]:
        steps.add_row(str(r.step), _fmt(r.loss), _fmt(r.reward), _fmt(r.metrics.get("kl_k3")),
                      _fmt(r.metrics.get("numerics_k3")), _fmt(r.metrics.get("drift_k3")),
                      _fmt(r.metrics.get("ratio_max")), _fmt(r.staleness_mean), _fmt(r.idle_share, pct=True),
                      str(r.dropped))
    return Group(head, Columns([training, mismatch, staleness, dropped, _eval_view(s), _reward_split(s)],
                                        padding=(1, 4)), workers,
                 steps)


def _eval_view(s: Snapshot) -> Table:
    e = s.latest_eval
    if e is None:
        return _pairs("held-out eval", [("version", "-")])
    return _pairs("held-out eval", [
        ("version", str(e.version)), ("reward mean", _fmt(e.mean_reward)), ("pass@1", _fmt(e.pass_at_1)),
        (f"pass@{e.samples_per_prompt}", _fmt(e.pass_at_k)), ("prompts", str(e.prompts)),
        ("versions skipped", str(s.eval_skipped)),
        *((f"task {task}", _fmt(mean)) for task, mean in e.per_task.items()),
    ])


def _reward_split(s: Snapshot) -> Table:
    """The training reward per task of a mixture and per part of a rubric (last K groups)."""
    return _pairs("reward split", [*((f"task {task}", _fmt(mean)) for task, mean in s.reward_by_task.items()),
                                   *((f"part {part}", _fmt(mean)) for part, mean in s.reward_parts.items())])
