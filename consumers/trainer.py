"""The online trainer: groups in, committed policy versions out.

    wait    read the `trainer` group on trajectories + routing, join by group id, drop groups
            older than max_off_policy_steps (recorded), until batch_groups are ready
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
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis.asyncio as aioredis
import torch

from reel.bus.blobs import BlobBackend
from reel.bus.errors import ReelError
from reel.bus.events import (
    AnyEvent, DroppedGroup, MalformedEvent, RoutingTrace, RunStarted, StepCommitted, StepTiming, Trajectory,
    WeightsPublished, decode,
)
from reel.bus.log import LogCorrupted, LogError, RunLog
from reel.bus.partitions import lane_key, lanes
from reel.bus.retention import Retention
from reel.bus.seqs import recover_seq
from reel.bus.streams import FIELD, Delivery, GroupConsumer, Publisher, connect
from reel.bus.trust import Order, SeqMarks, trusted
from reel.consumers.trainer_retention import retain, trainer_retention
from reel.runtime import work_progress
from reel.runtime.train import distributed
from reel.runtime.train import environment
from reel.runtime.train.batch import Group, build_batch, decode_routing, routing_problem
from reel.runtime.blob_store import run_blobs
from reel.runtime.config.sections import Config
from reel.runtime.config.run import config_hash
from reel.runtime.config.run import load as load_config
from reel.runtime.config.data_files import dataset_sha256
from reel.runtime.heartbeat import BEAT_SUFFIX, Heartbeat
from reel.runtime.train.group_checks import group_problem
from reel.runtime.train.groups import GroupLookup
from reel.runtime.train.initial_policy import code_version, ensure_initial_policy, initial_reward
from reel.runtime.train.mismatch_split import WeightHistory
from reel.runtime.train.reexecute import catch_up, checkpoint_before
from reel.runtime.train.step import TrainState
from reel.runtime.train.trainer_group import TrainerGroup, run_as_group

log = logging.getLogger("reel.trainer")
PRODUCER = "trainer:0"
PUBLISHED_STREAMS = ("control", "weights", "steps")
NEVER_RECLAIM_MS = 7 * 24 * 3600 * 1000
# Test hook: REEL_CRASH_AT="<step>:<stage>" kills the trainer with SIGKILL at that point.
CRASH_STAGES = ("computed", "weights_written", "checkpoint_written", "committed", "acked")
# Exit code of a trainer stopped (SIGTERM/SIGINT) before its last step: not a finished run, so
# neither the launcher nor the Slurm job may announce RunFinished("completed").
STOPPED_EXIT = 143


@dataclass
class PendingGroup:
    trajectory: Delivery | None = None
    routing: Delivery | None = None
    resolved: Group | None = None  # routing decoded and checked, once both parts are here

    def deliveries(self) -> list[Delivery]:
        return [d for d in (self.trajectory, self.routing) if d is not None]


@dataclass
class Collected:
    groups: list[tuple[str, PendingGroup]] = field(default_factory=list)
    dropped: list[tuple[DroppedGroup, PendingGroup]] = field(default_factory=list)


class Trainer:
    config: Config
    run_dir: Path
    url: str
    run: str
    blobs: BlobBackend
    group: TrainerGroup
    redis: aioredis.Redis
    consumer: GroupConsumer
    publisher: Publisher
    state: TrainState
    committed_groups: set[str]
    pending: dict[str, PendingGroup]
    weights: WeightHistory  # published versions, for the mismatch split of stale tokens
    retention: Retention  # which published versions the blob store may let go
    heartbeat: Heartbeat  # what it does, for the launcher's liveness check

    def __init__(self, run_dir: Path, url: str, config: Config, group: TrainerGroup | None = None):
        self.config = config
        self.run_dir = run_dir
        self.url = url
        self.run = config.run.name
        self.blobs = run_blobs(run_dir, config)
        self.group = group or TrainerGroup(distributed.LOCAL, run_dir, config)
        self.committed_groups = set()
        self.pending = {}
        self.weights = WeightHistory(self.blobs, keep=config.trainer.max_off_policy_steps + 1)
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
        collected = await self._collect(stop)
        if stop.is_set():
            return
        waited = time.perf_counter() - started
        cpu_started = time.process_time()
        self.heartbeat.progress("training", f"step {self.state.step + 1}")
        batch = build_batch([part.resolved for _, part in collected.groups])
        self.state, result = await asyncio.to_thread(self.group.step, self.state, batch, self.weights.get)
        computed = time.perf_counter()
        cpu_s = time.process_time() - cpu_started
        step = self.state.step
        self._crash_point(step, "computed")
        weights, fmt = await asyncio.to_thread(self.group.publish, self.state, self.blobs)
        self.weights.add(step, weights, fmt)
        self._crash_point(step, "weights_written")
        ckpt = None
        if step % self.config.trainer.checkpoint_every == 0 or step == self.config.run.steps:
            ckpt = await asyncio.to_thread(lambda: self.blobs.put(self.group.checkpoint(self.state)))
        self._crash_point(step, "checkpoint_written")
        used = [gid for gid, _ in collected.groups]
        dropped = [d for d, _ in collected.dropped]
        commit = self.publisher.stamp(
            StepCommitted, step=step, version=step, groups=used, dropped=dropped, loss=result.loss,
            grad_norm=result.grad_norm, weights_sha256=result.weights_sha256,
            timing=StepTiming(wait=waited, compute=computed - started - waited, publish=time.perf_counter() - computed),
            metrics={**result.metrics, **self.bus_loss}, staleness=result.staleness, checkpoint=ckpt,
            config_hash=config_hash(self.config), code_version=code_version(), world_size=self.group.world.size,
            layout=environment.layout(self.config), libraries=environment.library_versions(), cpu_s=cpu_s,
        )
        published = self.publisher.stamp(WeightsPublished, version=step, step=step, weights=weights, format=fmt)
        await self.publisher.publish_atomic([published, commit])
        self._crash_point(step, "committed")
        self.bus_loss = {}
        self.committed_groups.update(used)
        self.committed_groups.update(d.group_id for d in dropped)
        await self.consumer.ack([d for _, part in collected.groups + collected.dropped for d in part.deliveries()])
        self._crash_point(step, "acked")
        self.heartbeat.progress("committed", f"step {step}")
        await retain(self.retention, self.publisher, [published, commit], step)
        m = result.metrics
        log.info("step %d committed: loss %.4f grad_norm %.3f reward %.3f kl_k3 %.2e (numerics %.2e drift %.2e) "
                 "dropped %d", step, result.loss, result.grad_norm, m.get("reward_mean", 0.0), m.get("kl_k3", 0.0),
                 m.get("numerics_k3", 0.0), m.get("drift_k3", 0.0), len(dropped))

    async def _collect(self, stop: asyncio.Event) -> Collected:
        """Read until batch_groups fresh groups are complete; stale ones are set aside as dropped."""
        out = Collected()
        want = self.config.trainer.batch_groups
        for group_id, part in list(self.pending.items()):  # complete groups left over from the last step
            self._offer(group_id, part, out)
        while len(out.groups) < want and not stop.is_set():
            self.heartbeat.alive("waiting for groups", f"{len(out.groups)} of {want} for step {self.state.step + 1}",
                                 waiting=True)
            for delivery in await self.consumer.read(count=2 * want):
                event = delivery.event
                if not isinstance(event, (Trajectory, RoutingTrace)):
                    await self.consumer.dead_letter(delivery, f"unexpected {type(event).__name__} on {delivery.stream}")
                    continue
                if event.group_id in self.committed_groups:
                    await self.consumer.ack([delivery])  # re-delivered after a crash; already trained
                    continue
                part = self.pending.setdefault(event.group_id, PendingGroup())
                if isinstance(event, Trajectory):
                    part.trajectory = delivery
                else:
                    part.routing = delivery
                self._offer(event.group_id, part, out)
        return out

    def _offer(self, group_id: str, part: PendingGroup, out: Collected) -> None:
        """Move a complete group into this step's batch or its dropped list; beyond the batch it waits."""
        if part.trajectory is None or part.routing is None:
            return
        assert isinstance(part.trajectory.event, Trajectory)
        reason = (self._invalid_reason(part.trajectory.event) or self._stale_reason(part.trajectory.event)
                  or self._resolve(part))
        if reason is not None:
            out.dropped.append((DroppedGroup(group_id, reason), part))
        elif len(out.groups) < self.config.trainer.batch_groups:
            out.groups.append((group_id, part))
        else:
            return
        del self.pending[group_id]

    def _invalid_reason(self, trajectory: Trajectory) -> str | None:
        problem = group_problem(trajectory, self.state.model.config.vocab_size)
        return f"invalid: {problem}" if problem else None

    def _stale_reason(self, trajectory: Trajectory) -> str | None:
        oldest = min((v for s in trajectory.samples for _, v in s.spans), default=self.state.step)
        behind = self.state.step - oldest
        limit = self.config.trainer.max_off_policy_steps
        return f"stale: {behind} versions behind > max_off_policy_steps = {limit}" if behind > limit else None

    def _resolve(self, part: PendingGroup) -> str | None:
        """Decode and check the group's routing into part.resolved; why it cannot be trained, if so.

        A trace that does not match its tokens is dropped with its group (recorded in the commit):
        training it without router replay would turn R3 off for the whole step."""
        assert part.trajectory is not None and part.routing is not None
        trace = part.routing.event
        assert isinstance(trace, RoutingTrace) and isinstance(part.trajectory.event, Trajectory)
        model = self.state.model.config
        try:
            blob = self.blobs.get(trace.blob) if trace.blob else None
            group = Group(part.trajectory.event, decode_routing(trace, blob))
            # Without router replay a trace is not used: an engine that cannot capture routing (vLLM on a
            # CPU) sends empty ones, which must not drop every group.
            problem = (routing_problem(group, len(model.moe_layers), model.num_experts_per_tok, model.num_experts)
                       if self.config.trainer.router_replay else None)
        except (ReelError, ValueError) as exc:  # a missing or corrupted blob, bytes that do not fit the shape
            problem = f"routing trace unreadable: {exc}"
        if problem is not None:
            return f"bad_routing: {problem}"
        part.resolved = group
        return None

    async def _setup_or_resume(self) -> None:
        commits = await self._read_commits()
        published = logged_events(self.run_dir, "weights") + await self._bus_events("weights")
        for event in published:
            if isinstance(event, WeightsPublished):
                self.weights.add(event.version, event.weights, event.format)
        pruned = logged_events(self.run_dir, "control") + await self._bus_events("control")  # CheckpointsPruned
        self.retention.add([*published, *commits.values(), *pruned])
        await asyncio.to_thread(ensure_initial_policy, self.run_dir, self.config)
        if not commits:
            self.state = await asyncio.to_thread(self.group.initial_state)
            await self._publish_version_zero()
            return
        last = max(commits)
        for c in commits.values():
            self.committed_groups.update(c.groups)
            self.committed_groups.update(d.group_id for d in c.dropped)
        state = await asyncio.to_thread(self.group.restore, *checkpoint_before(commits, last, self.blobs))
        if state.step < last:
            lookup = await self._group_lookup()
            log.info("resuming: re-executing steps %d..%d from %s", state.step + 1, last,
                     "the initial weights" if state.step == 0 else f"the checkpoint of step {state.step}")
            state = await asyncio.to_thread(catch_up, state, commits, last, lookup, self.config,
                                            step_fn=self.group.step)
        self.state = state
        await self._republish_newest_weights(last)
        log.info("resumed after step %d (%d groups already committed)", last, len(self.committed_groups))

    async def _publish_version_zero(self) -> None:
        if await self._stream_has(WeightsPublished):
            return
        model = self.state.model
        weights, fmt = await asyncio.to_thread(self.group.publish, self.state, self.blobs)
        self.weights.add(0, weights, fmt)
        events = [self.publisher.stamp(WeightsPublished, version=0, step=0, weights=weights, format=fmt)]
        if not await self._stream_has(RunStarted):
            config_text = (self.run_dir / "config.toml").read_text()
            events.insert(0, self.publisher.stamp(
                RunStarted, config_toml=config_text, seed=self.config.run.seed, code_version=code_version(),
                model_config=model.config.to_hf_dict(), config_hash=config_hash(self.config),
                init_reward=initial_reward(self.run_dir), layout=environment.layout(self.config),
                libraries=environment.library_versions(), cpu_count=environment.cpu_count(),
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


def main(run_dir: Path, bus_url: str) -> int:
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
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):  # a warm-start in progress stops too (work_progress)
            loop.add_signal_handler(sig, lambda: (stop.set(), work_progress.cancel()))
        trainer = Trainer(run_dir, bus_url, config, group)
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
