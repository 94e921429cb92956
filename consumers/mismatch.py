"""The mismatch role: each committed step's numerics/drift split, beside the trainer, as MismatchSplit events.

    follow   the steps and weights streams, and trajectories + routing for the groups a commit names,
             by plain XREAD (a Tail): nothing the trainer reads, acks or waits on
    compute  for a due step N (mismatch.every: K, 2K, ... and the last): the batch of N's groups scored
             by version N-1 (π_old) and by each older version its tokens were sampled under
             (runtime/train/mismatch_split.py `step_split`, the function `reel replay step N` checks it with)
    publish  MismatchSplit(step, figures, versions, lag) on the steps stream; the archiver logs it

The trainer never waits on it, so it may lag: it splits every due step in order and each event says
how far behind it was (lag_steps, lag_s). A group already trimmed from the bus is read from the log
(through its index). The blob store keeps mismatch.max_lag_steps more policy versions for it
(bus/retention.py); a step whose π_old weights are gone all the same (the role lagged further) is
passed over with a warning: `reel replay step N` re-derives those weights.
On restart it goes on after the last step it published (its events in the log and on the bus), and
it exits 0 once the last step (run.steps) is split. It runs at CPU priority mismatch.nice (default 19,
the lowest): its forward passes (one per policy version a batch spans, as many as the trainer's
scoring of π_old) take only the CPU that the trainer and the rollout workers leave. At the default
priority on examples/slow_calc.toml's 2-core bench it took 15 CPU seconds of a 30-second
async run from the rollout worker's core (docs/benchmarks.md). It needs the whole model in one process: on large
models sample it (mismatch.every = K) or switch it off (0).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from pathlib import Path

import torch

from reel.bus.blobs import BlobBackend
from reel.bus.errors import ReelError
from reel.bus.events import AnyEvent, MismatchSplit, RoutingTrace, StepCommitted, Trajectory, WeightsPublished
from reel.bus.log import LogCorrupted, LogError
from reel.bus.run_log import RunLog
from reel.bus.seqs import recover_seq
from reel.bus.streams import Publisher, connect
from reel.bus.tail import Tail
from reel.bus.trust import SeqMarks, trusted
from reel.runtime.blob_store import run_blobs
from reel.runtime.config.run import load as load_config
from reel.runtime.config.sections import Config
from reel.runtime.model.determinism import set_determinism
from reel.runtime.model.model import MoEModel
from reel.runtime.model.weights import load_state_dict_bytes
from reel.runtime.train.batch import Group, build_batch
from reel.runtime.train.environment import cpus, nice
from reel.runtime.train.groups import GroupLookup, MissingGroup
from reel.runtime.train.initial_policy import load_initial_model
from reel.runtime.train.mismatch_split import Split, WeightHistory, step_split
from reel.runtime.role_loop import serve

log = logging.getLogger("reel.mismatch")
PRODUCER = "mismatch:0"
FOLLOWED = ["steps", "weights", "trajectories", "routing"]
LOG_SYNC_S = 2.0  # caught up with the bus: how often the log is read again for events trimmed before this role read them


def due(step: int, every: int, last: int) -> bool:
    return every > 0 and (step % every == 0 or step == last)


class MismatchRole:
    """Follows the commits; splits each due step's mismatch; publishes MismatchSplit."""

    # Fixed at construction.
    run_dir: Path
    url: str
    config: Config
    blobs: BlobBackend
    # Progress.
    weights: WeightHistory  # published versions: π_old and the older sampling versions
    groups: GroupLookup  # groups read from the bus (until a commit uses them), else the log's index
    commits: dict[int, tuple[StepCommitted, float]]  # due steps not yet split -> (commit, its bus time)
    done: set[int]  # steps split (this role's events, before a restart too) or passed over
    newest: int  # the newest committed step seen
    model: MoEModel | None  # loaded with π_old of the step being split

    def __init__(self, run_dir: Path, url: str, config: Config) -> None:
        self.run_dir, self.url, self.config = Path(run_dir), url, config
        self.blobs = run_blobs(run_dir, config)
        self.weights = WeightHistory(self.blobs, keep=config.trainer.max_off_policy_steps + 2)
        self.groups = GroupLookup(self.blobs)
        self.commits = {}
        self.done = set()
        self.newest = 0
        self.model = None
        self._learn_logged()  # a restarted role finds there what was trimmed from the bus

    @property
    def needs_log(self) -> bool:
        """The oldest due step waits on π_old's WeightsPublished, which the bus may have trimmed before this
        role read it: only the log has it then."""
        return bool(self.commits) and min(self.commits) - 1 not in self.weights.refs

    @property
    def finished(self) -> bool:
        return self.config.run.steps in self.done

    async def run(self, stop: asyncio.Event) -> None:
        c = self.config
        redis = connect(self.url)
        marks = SeqMarks(c.run.name, c.bus.partitions)
        try:
            seq = await recover_seq(redis, self.run_dir, c.run.name, PRODUCER, ["steps"], c.bus.partitions)
            publisher = Publisher(redis, c.run.name, PRODUCER, seq)
            async with Tail(self.url, c.run.name, FOLLOWED, start="0", partitions=c.bus.partitions) as tail:
                caught_up = False  # the bus read to its end once: this role's own earlier events are known
                synced = time.monotonic()  # when the log was last read for what the bus lost
                while not stop.is_set() and not self.finished:
                    entries = await tail.read(count=500, block_ms=1000 if caught_up else 0)
                    caught_up = caught_up or not entries
                    if (not entries or self.needs_log) and time.monotonic() - synced > LOG_SYNC_S:
                        self._learn_logged()
                        synced = time.monotonic()
                    kept = await trusted(redis, c.run.name, marks,
                                         [(f"entry {entry_id} of {lane}", event) for lane, entry_id, event in entries])
                    times = {id(event): entry_seconds(entry_id) for _, entry_id, event in entries}
                    for event in kept:
                        self._learn(event, times[id(event)])
                    while caught_up and not stop.is_set() and (event := await self._next_split()) is not None:
                        await publisher.publish([publisher.stamp(MismatchSplit, **event, cpus=cpus(), nice=nice())])
        finally:
            await asyncio.shield(redis.aclose())

    def _learn_logged(self) -> None:
        """The weights and commits the archiver has logged. The bus is trimmed once the archiver and the
        trainer have read it, not this role, so a role that lags (it runs at the lowest CPU priority)
        can find commits gone before it read them: without this it never split them, not even with a
        warning, and, missing the last one, waited for it until `reel run` gave up (300 s)."""
        for stream in ("weights", "steps"):
            for entry_id, event in logged(self.run_dir, stream):
                self._learn(event, entry_seconds(entry_id))

    def _learn(self, event: AnyEvent, at: float) -> None:
        match event:
            case WeightsPublished():
                self.weights.add(event.version, event.weights, event.format)
            case Trajectory() | RoutingTrace():
                self.groups.add([event])
            case StepCommitted():
                self.newest = max(self.newest, event.step)
                if due(event.step, self.config.mismatch.every, self.config.run.steps) and event.step not in self.done:
                    self.commits.setdefault(event.step, (event, at))
                else:
                    self._forget(event)
            case MismatchSplit() if event.producer == PRODUCER:
                self.done.add(event.step)
                self.commits.pop(event.step, None)

    async def _next_split(self) -> dict | None:
        """The fields of the oldest due step's MismatchSplit, once its groups are readable; None to read on."""
        for step in sorted(self.commits):
            if step in self.done:
                del self.commits[step]
                continue
            commit, at = self.commits[step]
            if step - 1 not in self.weights.refs:
                return None  # π_old's WeightsPublished: not read yet (from the bus, or the log once archived)
            groups = await asyncio.to_thread(self._groups_of, commit)
            if groups is None:
                return None  # its groups are neither read from the bus yet nor archived
            started = time.monotonic()
            split = await asyncio.to_thread(self._split, commit, groups)
            del self.commits[step]
            self._forget(commit)
            self.done.add(step)
            if split is None:
                continue
            lag_steps, lag_s = self.newest - step, time.time() - at
            log.info("step %d: numerics k3 %.3e drift k3 %.3e over %d versions (%d steps behind, %.1f s)", step,
                     split.figures["numerics_k3"], split.figures["drift_k3"], len(split.versions), lag_steps, lag_s)
            return {"step": step, "figures": split.figures, "versions": split.versions,
                    "missing_versions": split.missing, "lag_steps": lag_steps, "lag_s": lag_s,
                    "compute_s": time.monotonic() - started}
        return None

    def _groups_of(self, commit: StepCommitted) -> list[Group] | None:
        try:
            return self.groups.groups_of(commit)
        except MissingGroup:
            pass
        try:  # trimmed from the bus before this role read it: the archiver has it
            with RunLog(self.run_dir, readonly=True) as run_log:
                archived = GroupLookup.from_log(run_log, self.blobs)
                archived.add([*self.groups.trajectories.values(), *self.groups.routing.values()])
                return archived.groups_of(commit)
        except LogCorrupted:
            raise
        except (LogError, MissingGroup):
            return None

    def _split(self, commit: StepCommitted, groups: list[Group]) -> Split | None:
        current = commit.step - 1
        weights = self.weights.get(current)
        if weights is None:
            log.warning("step %d passed over: the weights of version %d are gone (retention deleted them: this role "
                        "lagged more than mismatch.max_lag_steps = %d); `reel replay step %d` re-derives them",
                        commit.step, current, self.config.mismatch.max_lag_steps, commit.step)
            return None
        if self.model is None:
            self.model = load_initial_model(self.run_dir)
        load_state_dict_bytes(self.model, weights)
        return step_split(self.model, build_batch(groups), self.config.trainer, current, self.weights.get)

    def _forget(self, commit: StepCommitted) -> None:
        """A committed step's groups are never needed again (its dropped ones neither)."""
        for group_id in [*commit.groups, *(d.group_id for d in commit.dropped)]:
            self.groups.trajectories.pop(group_id, None)
            self.groups.routing.pop(group_id, None)


def entry_seconds(entry_id: str) -> float:
    """When Redis added the entry (its id starts with the millisecond), in Unix seconds."""
    return int(entry_id.split("-")[0]) / 1000


def logged(run_dir: Path, stream: str) -> list[tuple[str, AnyEvent]]:
    """(entry id, event) the archiver has made durable so far (none yet is fine: the bus has the rest)."""
    try:
        with RunLog(run_dir, readonly=True) as run_log:
            return list(run_log.events(stream)) if stream in run_log.names() else []
    except LogCorrupted:
        raise
    except LogError:
        return []


def lower_priority(nice: int) -> None:
    """os.nice(nice), and the same for this process's autogroup when it leads its own session.

    Linux's autogroup scheduler (on by default outside cgroups) shares a core between sessions first and
    applies nice only within one; `reel run` starts each role in its own session, so os.nice alone left the
    role an equal share beside the rollout worker (12 CPU seconds to its 9.5 in a 24-second run). Only a
    session leader's autogroup is its own: run from a shell, the role leaves the shell's alone."""
    os.nice(nice)
    if os.getsid(0) != os.getpid():
        return
    try:
        Path("/proc/self/autogroup").write_text(str(nice))
    except OSError:  # no autogroup (another OS, a kernel without it): nice is all there is
        pass


def main(run_dir: Path, bus_url: str) -> int:
    """`reel role mismatch`: run until the last step is split, or SIGTERM/SIGINT."""
    config = load_config(Path(run_dir) / "config.toml")
    logging.basicConfig(level=config.log.level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    lower_priority(config.mismatch.nice)  # an analysis role: never ahead of training for a CPU
    # The trainer's thread count and deterministic kernels: the same bits as the trainer's π_old and replay's.
    threads = config.trainer.threads or 1
    torch.set_num_threads(threads)
    set_determinism(config.run.seed, threads=threads)
    role = MismatchRole(Path(run_dir), bus_url, config)

    try:
        serve(role.run)
    except ReelError as exc:
        log.error("%s", exc)
        return 1
    return 0
