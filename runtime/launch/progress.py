"""The launcher's progress view: step, reward, KL k3, staleness, tokens/s, trainer idle.

It is one more reader of the bus (plain XRANGE on the steps and control streams, no consumer
group), so watching never slows the trainer. A TTY gets a rich live table; anything else gets one
line per committed step.
"""

from __future__ import annotations

import time
from pathlib import Path

import redis
from rich.console import Console
from rich.live import Live
from rich.table import Table

from reel.bus.events import MalformedEvent, MismatchSplit, RunStarted, StepCommitted, decode, stream_key
from reel.runtime.config.sections import Config
from reel.runtime.fit_tables import fit
from reel.runtime.heartbeat import read_beats
from reel.runtime.work_progress import Work, describe, read

THROUGHPUT_WINDOW = 5  # steps the tokens/s figure is measured over
WORK_LINE_EVERY_S = 10.0  # without a terminal, a line per this many seconds of long work (the warm-start)
QUIET_S = 10.0  # a trainer this long without progress: the live view says what it does


class Progress:
    url: str
    config: Config
    live: bool
    resumed_after: int
    steps: list[StepCommitted]
    splits: dict[int, dict[str, float]]  # step -> the mismatch role's MismatchSplit figures (they lag the steps)
    _cursor: dict[str, str]
    _client: redis.Redis | None
    _live: Live | None
    _console: Console
    _started: float

    def __init__(self, url: str, config: Config, *, live: bool, resumed_after: int = 0, work_file: Path | None = None):
        self.url = url
        self.config = config
        self.live = live
        self.resumed_after = resumed_after  # steps up to this one were shown by an earlier `reel run`
        self.work_file = work_file  # a role's long work before the first step (runtime/work_progress.py)
        self._work_shown: tuple[tuple[str, bool], float] | None = None  # ((what, finished), when) last printed
        self.steps = []
        self.splits = {}
        self._cursor = {"steps": "0", "control": "0"}
        self._client = None
        self._live = None
        self._console = Console(soft_wrap=True)  # one line per step when not a terminal
        self._started = time.monotonic()

    def __enter__(self) -> Progress:
        if self.live:
            self._live = Live(self._table(), console=self._console, refresh_per_second=2, transient=False)
            self._live.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._live is not None:
            self._live.__exit__(*exc)
        self._close()

    def _close(self) -> None:
        # A closed cluster client cannot be used again (a plain one reconnects): drop it.
        if self._client is not None:
            self._client.close()
            self._client = None

    def refresh(self) -> None:
        """Read what is new on the bus and redraw; a bus hiccup only delays the view."""
        try:
            new_steps = self._read()
        except (redis.RedisError, redis.RedisClusterException):  # the latter: no cluster node answers
            return
        work = self._work()
        if self._live is not None:
            table = self._table()
            table.caption = describe(work) if work else self.trainer_doing()
            self._live.update(fit(table, self._console))
        else:
            self._print_work(work)
            for step in new_steps:
                if step.step > self.resumed_after:
                    self._console.print(self._line(step), highlight=False)

    def _work(self) -> Work | None:
        """What a role is busy with before the first commit (the warm-start), if it says."""
        if self.steps or self.work_file is None:
            return None
        return read(self.work_file)

    def trainer_doing(self, quiet_s: float = QUIET_S) -> str | None:
        """What the trainer does, once it has made no progress for quiet_s (its heartbeat,
        runtime/heartbeat.py): the live view says what it waits for instead of going silent."""
        beat = read_beats(self.work_file.parent).get("trainer") if self.work_file is not None else None
        if beat is None or time.time() - beat.progress_at < quiet_s:
            return None
        detail = f", {beat.detail}" if beat.detail else ""
        return f"trainer: {beat.phase}{detail} (no progress for {time.time() - beat.progress_at:.0f} s)"

    def _print_work(self, work: Work | None) -> None:
        """A line when a work starts or ends, and every WORK_LINE_EVERY_S seconds in between."""
        if work is None:
            return
        key, now = (work.what, work.done >= work.total), time.monotonic()
        if self._work_shown is None or self._work_shown[0] != key or (
                not key[1] and now - self._work_shown[1] >= WORK_LINE_EVERY_S):
            self._console.print(describe(work), highlight=False)
            self._work_shown = (key, now)

    def finish(self, run_dir: Path) -> None:
        self.refresh()
        self._close()
        minutes = (time.monotonic() - self._started) / 60
        if self.steps:
            # The view may have missed steps (trimmed from the bus before it read them): the last
            # commit's number is what the run did, not the number of lines shown.
            first, last = self.steps[0], self.steps[-1]
            session = f" ({last.step - self.resumed_after} since the resume)" if self.resumed_after else ""
            self._console.print(
                f"run finished: {last.step} steps{session} in {minutes:.1f} min, reward "
                f"{first.metrics.get('reward_mean', float('nan')):.3f} -> "
                f"{last.metrics.get('reward_mean', float('nan')):.3f}; log in {run_dir / 'log'}\n"
                f"final policy: step {last.step}, weights sha256 {last.weights_sha256[:12]} in {run_dir / 'blobs'}; "
                f"`reel export --run {run_dir} --out {run_dir / 'export'}` writes it as a Hugging Face model",
                highlight=False,
            )

    def _read(self) -> list[StepCommitted]:
        if self._client is None:
            from reel.bus.cluster import cluster_from_env  # bus.cluster = true: the launcher set REEL_BUS_CLUSTER

            client_class = redis.RedisCluster if cluster_from_env() else redis.Redis
            self._client = client_class.from_url(self.url, socket_timeout=5.0)
        new_steps: list[StepCommitted] = []
        for stream in ("steps", "control"):
            entries = self._client.xrange(stream_key(self.config.run.name, stream), min=f"({self._cursor[stream]}"
                                          if self._cursor[stream] != "0" else "-", count=500)
            for entry_id, fields in entries:
                self._cursor[stream] = entry_id.decode()
                try:
                    event = decode(fields.get(b"e", b""))
                except MalformedEvent:
                    continue  # not an event: the archiver dead-letters it; the view goes on
                if isinstance(event, StepCommitted):
                    shown = (self.steps + new_steps)[-1].step if self.steps or new_steps else 0
                    if event.step > shown:  # else a copy of a write retried in a Redis pause (bus/redis_boundary.py)
                        new_steps.append(event)
                elif isinstance(event, MismatchSplit):
                    self.splits[event.step] = event.figures
                elif isinstance(event, RunStarted) and event.init_reward is not None and not self.resumed_after:
                    self._console.print(f"warm-start policy (version 0): mean sampled reward "
                                        f"{event.init_reward:.3f}", highlight=False)
        self.steps.extend(new_steps)
        return new_steps

    def _line(self, s: StepCommitted) -> str:
        idle = _idle_share(s)
        m = s.metrics
        nan = float("nan")
        # The mismatch role splits a step after its commit: the line shows the newest split there is.
        newest = max(self.splits, default=None)
        split = (f" (numerics {self.splits[newest]['numerics_k3']:.2e} drift {self.splits[newest]['drift_k3']:.2e}"
                 f"{'' if newest == s.step else f' at step {newest}'})" if newest is not None else "")
        return (
            f"step {s.step}/{self.config.run.steps}  reward {m.get('reward_mean', nan):.3f}  "
            f"kl_k3 {m.get('kl_k3', nan):.2e}{split}  staleness {_mean_staleness(s):.2f}  "
            f"tokens/s {tokens_per_s(self.steps, s.step):.0f}  trainer idle {idle:.0%}  "
            f"dropped {len(s.dropped)}"
        )

    def _table(self) -> Table:
        table = Table(title=f"reel run {self.config.run.name}", expand=False)
        for column in ("step", "reward", "kl k3", "numerics k3", "drift k3", "staleness", "tokens/s", "trainer idle",
                       "dropped"):
            table.add_column(column, justify="right")
        for s in self.steps[-12:]:
            idle = _idle_share(s)
            table.add_row(
                f"{s.step}/{self.config.run.steps}", f"{s.metrics.get('reward_mean', float('nan')):.3f}",
                *(f"{figures[key]:.2e}" if key in figures else "-"
                  for figures in [{**s.metrics, **self.splits.get(s.step, {})}]
                  for key in ("kl_k3", "numerics_k3", "drift_k3")),
                f"{_mean_staleness(s):.2f}",
                f"{tokens_per_s(self.steps, s.step):.0f}", f"{idle:.0%}", str(len(s.dropped)),
            )
        return table


def tokens_per_s(steps: list[StepCommitted], upto: int, window: int = THROUGHPUT_WINDOW) -> float:
    """Trained tokens per second over the last `window` steps up to step `upto`: the tokens each
    commit trained (its staleness histogram counts them) over the wall time the trainer spent on
    those steps (waiting for groups included), so it is the pipeline's rate from the first step on."""
    recent = [s for s in steps if s.step <= upto][-window:]
    seconds = sum(s.timing.wait + s.timing.compute + s.timing.publish for s in recent)
    return sum(sum(s.staleness.values()) for s in recent) / seconds if seconds > 0 else 0.0


def _mean_staleness(s: StepCommitted) -> float:
    tokens = sum(s.staleness.values())
    return sum(k * v for k, v in s.staleness.items()) / tokens if tokens else 0.0


def _idle_share(s: StepCommitted) -> float:
    return s.timing.wait / max(1e-9, s.timing.wait + s.timing.compute + s.timing.publish)
