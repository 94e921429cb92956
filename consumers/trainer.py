"""The online trainer: groups in, committed policy versions out.

    wait    read the `trainer` group on trajectories + routing, join by group id, drop groups
            older than max_off_policy_steps or invalid (recorded, and announced at once as
            GroupsDropped), until batch_groups are ready (consumers/trainer_batches.py)
    compute train_step (runtime/train/step.py), in a thread so the bus connection stays live
    commit  1. new weights -> blob store      2. checkpoint -> blob store (every checkpoint_every)
            3. WeightsPublished + StepCommitted in one MULTI/EXEC      4. ack the consumed entries
            5. delete the weight versions no worker or step can need any more, and the checkpoints
               log.keep_checkpoints lets go (consumers/trainer_retention.py)

Why this order: blobs are content-addressed, so re-writing them after a crash is harmless; the
commit is the single atomic point after which a group counts as trained; acking last means a
crash before the commit re-delivers every entry. On restart the trainer rebuilds its state from
the newest checkpoint plus re-execution of the committed steps after it (verified by weight
hash), and acks, without training, any re-delivered group a commit already lists.

On N ranks (trainer.ranks, started by torchrun) this loop runs on rank 0 only; every step,
checkpoint and weight export goes through runtime/train/trainer_group.py to all ranks, which the
other ranks serve in `follow`. The commit protocol above is rank 0's and unchanged.

Nothing in the step depends on the rollout running ahead: the mismatch split of older tokens is the
mismatch role's (consumers/mismatch.py), which follows the commits and never holds the trainer up.
Each commit's StepTiming records where the step's wall time went (wait, score_old, forward_backward,
optimizer, publish, and the previous step's commit).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from pathlib import Path

import redis.asyncio as aioredis
import torch

from reel.bus.blobs import BlobBackend
from reel.bus.events import (AnyEvent, DroppedGroup, GroupsDropped, MalformedEvent, RunStarted, StepCommitted,
                             StepTiming, WeightsPublished, decode)
from reel.bus.log import LogCorrupted, LogError
from reel.bus.run_log import RunLog
from reel.bus.partitions import lane_key, lanes
from reel.bus.retention import Retention
from reel.bus.seqs import recover_seq
from reel.bus.streams import FIELD, GroupConsumer, Publisher, connect
from reel.bus.trust import Order, SeqMarks, trusted
from reel.consumers.trainer_batches import BatchGatherer
from reel.consumers.trainer_retention import retain, trainer_retention
from reel.runtime import work_progress
from reel.runtime.train import distributed
from reel.runtime.train import environment
from reel.runtime.train.batch import build_batch
from reel.runtime.blob_store import run_blobs
from reel.runtime.config.sections import Config
from reel.runtime.config.run import config_hash
from reel.runtime.config.run import load as load_config
from reel.runtime.config.data_files import dataset_sha256
from reel.runtime.train.groups import GroupLookup
from reel.runtime.train.initial_policy import WarmStart, code_version, ensure_initial_policy, initial_reward
from reel.runtime.train.reexecute import catch_up, checkpoint_before
from reel.runtime.train.step import TrainState
from reel.runtime.train.trainer_group import TrainerGroup, run_as_group
from reel.runtime.heartbeat import BEAT_SUFFIX, Heartbeat
from reel.runtime.role_loop import stop_on_signals

log = logging.getLogger("reel.trainer")
PRODUCER = "trainer:0"
PUBLISHED_STREAMS = ("control", "weights", "steps")
NEVER_RECLAIM_MS = 7 * 24 * 3600 * 1000
# Test hook: REEL_CRASH_AT="<step>:<stage>" kills the trainer with SIGKILL at that point.
# StepTiming's phases inside compute, timed by train_step (StepResult.phases).
TRAIN_PHASES = ("score_old", "forward_backward", "optimizer")
CRASH_STAGES = ("computed", "weights_written", "checkpoint_written", "committed", "acked")
# Exit code of a trainer stopped (SIGTERM/SIGINT) before its last step: not a finished run, so
# neither the launcher nor the Slurm job may announce RunFinished("completed").
STOPPED_EXIT = 143


class Trainer:
    config: Config
    run_dir: Path
    url: str
    run: str
    blobs: BlobBackend
    group: TrainerGroup
    redis: aioredis.Redis
    consumer: GroupConsumer
    batches: BatchGatherer  # the wait: the next batch from the consumer's deliveries
    publisher: Publisher
    state: TrainState
    retention: Retention  # which published versions the blob store may let go
    heartbeat: Heartbeat  # what it does, for the launcher's liveness check
    commit_s: float  # the last step's commit protocol after its event was stamped (the next StepTiming.commit)
    warm_start: WarmStart  # makes version 0 when the config asks for a warm-start (passed in by the shell)

    def __init__(self, run_dir: Path, url: str, config: Config, warm_start: WarmStart,
                 group: TrainerGroup | None = None):
        self.config = config
        self.warm_start = warm_start
        self.run_dir = run_dir
        self.url = url
        self.run = config.run.name
        self.blobs = run_blobs(run_dir, config)
        self.group = group or TrainerGroup(distributed.LOCAL, run_dir, config)
        self.commit_s = 0.0
        self.retention = trainer_retention(run_dir, config, self.blobs)
        self.heartbeat = Heartbeat(run_dir / "roles" / f"trainer{BEAT_SUFFIX}")
        # A loss window the launcher found on resume (runtime/launch/bus_loss.py): recorded in the next commit.
        self.bus_loss = {key: float(os.environ[env]) for key, env in (
            ("bus_lost_events", "REEL_BUS_LOST_EVENTS"), ("bus_lost_window_s", "REEL_BUS_LOST_WINDOW_S"))
            if os.environ.get(env)}

    async def run_until_done(self, stop: asyncio.Event) -> None:
        self.redis = connect(self.url)
        # One trainer consumer with a fixed name: after a restart it re-reads its own pending
        # entries first, so it never needs to reclaim, and must not: it holds entries pending for
        # as long as a batch takes to fill, and self-claims would count as failed deliveries.
        self.consumer = GroupConsumer(
            self.url, self.run, "trainer", "trainer-0", ["trajectories", "routing"],
            block_ms=self.config.bus.block_ms, claim_idle_ms=NEVER_RECLAIM_MS,
            max_deliveries=self.config.bus.max_deliveries, partitions=self.config.bus.partitions,
        )
        self.batches = BatchGatherer(self.config, self.blobs, self.consumer, self.heartbeat, self._announce_drops)
        try:
            next_seq = await recover_seq(self.redis, self.run_dir, self.run, PRODUCER, PUBLISHED_STREAMS,
                                         self.config.bus.partitions)
            self.publisher = Publisher(self.redis, self.run, PRODUCER, next_seq)
            await self.consumer.start()
            await self._setup_or_resume()
            while self.state.step < self.config.run.steps and not stop.is_set():
                await self._one_step(stop)
        finally:
            await self.consumer.close()
            await self.redis.aclose()

    async def _one_step(self, stop: asyncio.Event) -> None:
        started = time.perf_counter()
        collected = await self.batches.collect(stop, self.state.step, self.state.model.config)
        if stop.is_set():
            return
        waited = time.perf_counter() - started
        cpu_started = time.process_time()
        self.heartbeat.progress("training", f"step {self.state.step + 1}")
        batch = build_batch([part.resolved for _, part in collected.groups])
        self.state, result = await asyncio.to_thread(self.group.step, self.state, batch)
        computed = time.perf_counter()
        cpu_s = time.process_time() - cpu_started
        step = self.state.step
        self._crash_point(step, "computed")
        weights, fmt = await asyncio.to_thread(self.group.publish, self.state, self.blobs)
        self._crash_point(step, "weights_written")
        ckpt = None
        if step % self.config.trainer.checkpoint_every == 0 or step == self.config.run.steps:
            ckpt = await asyncio.to_thread(lambda: self.blobs.put(self.group.checkpoint(self.state)))
        self._crash_point(step, "checkpoint_written")
        used = [gid for gid, _ in collected.groups]
        dropped = [d for d, _ in collected.dropped]
        stamped = time.perf_counter()
        timing = StepTiming(wait=waited, compute=computed - started - waited, publish=stamped - computed,
                            commit=self.commit_s, **{k: result.phases.get(k, 0.0) for k in TRAIN_PHASES})
        commit = self.publisher.stamp(
            StepCommitted, step=step, version=step, groups=used, dropped=dropped, loss=result.loss,
            grad_norm=result.grad_norm, weights_sha256=result.weights_sha256, timing=timing,
            metrics={**result.metrics, **self.bus_loss}, staleness=result.staleness, checkpoint=ckpt,
            config_hash=config_hash(self.config), code_version=code_version(), world_size=self.group.world.size,
            layout=environment.layout(self.config), libraries=environment.library_versions(), cpu_s=cpu_s,
        )
        published = self.publisher.stamp(WeightsPublished, version=step, step=step, weights=weights, format=fmt)
        await self.publisher.publish_atomic([published, commit])
        self._crash_point(step, "committed")
        self.bus_loss = {}
        self.batches.committed_groups.update(used)
        self.batches.committed_groups.update(d.group_id for d in dropped)
        await self.consumer.ack(collected.deliveries())
        self._crash_point(step, "acked")
        self.heartbeat.progress("committed", f"step {step}")
        await retain(self.retention, self.publisher, [published, commit], step)
        m = result.metrics
        log.info("step %d committed: loss %.4f grad_norm %.3f reward %.3f kl_k3 %.2e dropped %d", step, result.loss,
                 result.grad_norm, m.get("reward_mean", 0.0), m.get("kl_k3", 0.0), len(dropped))
        self.commit_s = time.perf_counter() - stamped

    async def _announce_drops(self, step: int, dropped: list[DroppedGroup]) -> None:
        """Groups set aside for `step`, ahead of its commit: their workers replace them now."""
        await self.publisher.publish([self.publisher.stamp(GroupsDropped, step=step, dropped=dropped)])

    async def _setup_or_resume(self) -> None:
        commits = await self._read_commits()
        published = logged_events(self.run_dir, "weights") + await self._bus_events("weights")
        pruned = logged_events(self.run_dir, "control") + await self._bus_events("control")  # CheckpointsPruned
        self.retention.add([*published, *commits.values(), *pruned])
        await asyncio.to_thread(ensure_initial_policy, self.run_dir, self.config, self.warm_start)
        if not commits:
            self.state = await asyncio.to_thread(self.group.initial_state)
            await self._publish_version_zero()
            return
        last = max(commits)
        for c in commits.values():
            self.batches.committed_groups.update(c.groups)
            self.batches.committed_groups.update(d.group_id for d in c.dropped)
        state = await asyncio.to_thread(self.group.restore, *checkpoint_before(commits, last, self.blobs))
        if state.step < last:
            lookup = await self._group_lookup()
            log.info("resuming: re-executing steps %d..%d from %s", state.step + 1, last,
                     "the initial weights" if state.step == 0 else f"the checkpoint of step {state.step}")
            state = await asyncio.to_thread(catch_up, state, commits, last, lookup, self.config,
                                            step_fn=self.group.step)
        self.state = state
        await self._republish_newest_weights(last)
        log.info("resumed after step %d (%d groups already committed)", last, len(self.batches.committed_groups))

    async def _publish_version_zero(self) -> None:
        if await self._stream_has(WeightsPublished):
            return
        model = self.state.model
        weights, fmt = await asyncio.to_thread(self.group.publish, self.state, self.blobs)
        events = [self.publisher.stamp(WeightsPublished, version=0, step=0, weights=weights, format=fmt)]
        if not await self._stream_has(RunStarted):
            config_text = (self.run_dir / "config.toml").read_text()
            events.insert(0, self.publisher.stamp(
                RunStarted, config_toml=config_text, seed=self.config.run.seed, code_version=code_version(),
                model_config=model.config.to_hf_dict(), config_hash=config_hash(self.config),
                init_reward=initial_reward(self.run_dir), layout=environment.layout(self.config),
                libraries=environment.library_versions(), cpu_count=environment.cpu_count(), cpus=environment.cpus(),
                dataset_sha256=dataset_sha256(self.config),
            ))
        await self.publisher.publish_atomic(events)
        self.retention.add(events)

    async def _stream_has(self, kind: type) -> bool:
        stream = "weights" if kind is WeightsPublished else "control"
        if any(isinstance(e, kind) for e in await self._bus_events(stream, count=1000)):
            return True
        return any(isinstance(e, kind) for e in logged_events(self.run_dir, stream))

    # Resume reads the bus before the log: an entry archived, acked and trimmed between the two
    # reads is in the log by the time it is read; the other way round it would be in neither.

    async def _read_commits(self) -> dict[int, StepCommitted]:
        """Every StepCommitted of the run: what is still on the bus plus the archived log."""
        on_bus = await self._bus_events("steps")
        commits = {e.step: e for e in logged_events(self.run_dir, "steps") if isinstance(e, StepCommitted)}
        order = Order()  # the log's commits, then the bus's only while each is the next step
        for commit in commits.values():
            order.learn(commit)
        for event in on_bus:
            if isinstance(event, StepCommitted):
                if problem := order.admit(event):
                    log.warning("skipping a StepCommitted of %s: %s", event.producer, problem)
                    continue
                commits.setdefault(event.step, event)
        return commits

    async def _group_lookup(self) -> GroupLookup:
        """The groups still on the bus, and the log's through its index (read a group at a time)."""
        on_bus = [event for stream in ("trajectories", "routing") for event in await self._bus_events(stream)]
        lookup = await asyncio.to_thread(indexed_groups, self.run_dir, self.blobs)
        lookup.add(on_bus)
        return lookup

    async def _bus_events(self, stream: str, count: int | None = None) -> list[AnyEvent]:
        """A stream's events on the bus (on each of its lanes), oldest first per lane; entries that are
        not events, or that bus/trust.py refuses, are skipped (the archiver dead-letters them), so one
        bad entry cannot stop or steer a resume."""
        events = []
        for lane in lanes([stream], self.config.bus.partitions):
            for entry_id, fields in await self.redis.xrange(lane_key(self.run, lane), count=count):
                try:
                    events.append((f"entry {entry_id.decode()} of {lane}", decode(fields.get(FIELD, b""))))
                except MalformedEvent as exc:
                    log.warning("skipping entry %s of %s: not an event (%s)", entry_id.decode(), lane, exc)
        return await trusted(self.redis, self.run, SeqMarks(self.run, self.config.bus.partitions), events)

    async def _republish_newest_weights(self, last: int) -> None:
        """Redis can lose its last second (AOF everysec) and with it WeightsPublished of the newest
        commit, which the log still has: workers follow the bus, so it goes there again."""
        if any(isinstance(e, WeightsPublished) and e.version >= last for e in await self._bus_events("weights")):
            return
        weights, fmt = await asyncio.to_thread(self.group.publish, self.state, self.blobs)
        await self.publisher.publish([self.publisher.stamp(WeightsPublished, version=last, step=last, weights=weights,
                                                           format=fmt)])
        log.warning("policy version %d was missing from the bus (Redis lost its last writes); published it again",
                    last)

    @staticmethod
    def _crash_point(step: int, stage: str) -> None:
        if os.environ.get("REEL_CRASH_AT") == f"{step}:{stage}":
            os.kill(os.getpid(), signal.SIGKILL)


def logged_events(run_dir: Path, stream: str) -> list[AnyEvent]:
    """Events the archiver has made durable so far (none yet is fine: the bus has the rest)."""
    try:
        with RunLog(run_dir, readonly=True) as run_log:
            return [event for _, event in run_log.events(stream)]
    except LogCorrupted:
        raise
    except LogError:
        return []


def indexed_groups(run_dir: Path, blobs: BlobBackend) -> GroupLookup:
    """The archived groups, located through the log's index (none archived yet: an empty lookup)."""
    try:
        with RunLog(run_dir, readonly=True) as run_log:
            return GroupLookup.from_log(run_log, blobs)
    except LogCorrupted:
        raise
    except LogError:
        return GroupLookup(blobs)


def main(run_dir: Path, bus_url: str, warm_start: WarmStart) -> int:
    import uvloop

    config = load_config(run_dir / "config.toml")
    # The thread count is part of what makes a step bit-exact (CPU reductions split by thread):
    # it comes from the config (trainer.threads, hashed into every commit), never the environment.
    torch.set_num_threads(config.trainer.threads or 1)
    logging.basicConfig(level=config.log.level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    world = distributed.from_env()
    if world.distributed:  # the pid of each rank, for operators (and tests)
        (run_dir / "roles" / f"trainer.rank{world.rank}.pid").write_text(str(os.getpid()))

    async def run(group: TrainerGroup) -> int:
        stop = asyncio.Event()
        stop_on_signals(stop, also=work_progress.cancel)  # a warm-start in progress stops too
        trainer = Trainer(run_dir, bus_url, config, warm_start, group)
        try:
            await trainer.run_until_done(stop)
        except work_progress.WorkCancelled as exc:
            log.warning("%s; the next run starts it again", exc)
            return STOPPED_EXIT
        if getattr(trainer, "state", None) is not None and trainer.state.step >= config.run.steps:
            return 0
        log.warning("stopped before the last step (run.steps = %d); resume the run to continue", config.run.steps)
        return STOPPED_EXIT

    return run_as_group(world, run_dir, config, lambda group: uvloop.run(run(group)))
