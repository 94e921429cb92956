"""Rollout worker: prompts from the env through the engine, out as Trajectory + RoutingTrace events.

    wait for policy version 0 (the `weights` stream) and for the `steps` stream to be read
    loop: wait for room (concurrency, async gate) -> start a group
          a group: seeded prompt -> episodes (producers/episode.py: engine turns, env turns) -> rewards ->
                   one Publisher.publish_atomic([Trajectory, RoutingTrace]) (MULTI: both or neither)
    background: newest WeightsPublished -> fetch + verify the blob -> engine.update_weights (in place,
                between two decode steps); StepCommitted -> last committed version; StepCommitted and
                GroupsDropped -> this worker's dropped groups (replaced); WorkerStats
    stop: start nothing new, finish in-flight groups for up to DRAIN_TIMEOUT_S, log the rest as
          abandoned (a partial group is never published)

Async gate (rollout.async_level): producers/async_gate.py. Where the wall time goes (WorkerStats
busy_s, tool_wait_s, idle_s): producers/time_split.py. Env calls: producers/tool_calls.py.

Identity: producer "rollout:<worker>"; its next seq is recovered from the bus and the run's log,
so a restart never reuses one; group ids are "<worker>-<seq base>-<counter>" with the seq base of
this process, unique across restarts. A group's prompt rng and sample seeds derive from
(run.seed, worker, seq base, counter).
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import time
from pathlib import Path

import msgspec
import numpy as np

from reel.bus.blobs import BlobBackend
from reel.bus.events import (AnyEvent, BlobRef, GroupsDropped, RoutingTrace, StepCommitted, Tensor, Trajectory,
                             WeightsPublished, WorkerStats)
from reel.bus.logcodec import pack
from reel.bus.partitions import worker_partition
from reel.bus.seqs import recover_seq
from reel.bus.streams import Publisher, connect
from reel.bus.tail import Tail, dead_letter_read
from reel.bus.trust import SeqMarks, trusted
from reel.bus.weight_manifest import WeightManifest
from reel.producers.async_gate import AsyncGate, newest_logged_commit
from reel.producers.draws import Draws, group_seed, recover_draws
from reel.producers.engine import Engine, SamplingParams
from reel.producers.envs import Env, env_for
from reel.producers.make_engine import make_engine
from reel.producers.episode import non_finite, run_group
from reel.producers.time_split import TimeSplit
from reel.producers.tool_calls import ToolCalls
from reel.producers.envs.rewards import RewardError
from reel.runtime.blob_store import run_blobs
from reel.runtime.train.environment import cpus
from reel.runtime.config.sections import Config
from reel.runtime.config.run import load
from reel.runtime.heartbeat import BEAT_SUFFIX, Heartbeat
from reel.runtime.train.initial_policy import init_dir
from reel.runtime.weights.load import WeightLoadError, engine_weights
from reel.runtime.role_loop import serve

log = logging.getLogger("reel.rollout")

ROUTING_INLINE_BYTES = 256 << 10  # a group's routing above this goes to the blob store
DRAIN_TIMEOUT_S = 10.0  # on stop, how long in-flight groups may take to finish (the launcher waits 20 s)
_READ = 100  # entries per XREAD of the followed streams
_PUBLISHED_STREAMS = ("trajectories", "routing", "control")


class RolloutWorker:
    # Fixed at construction.
    run_dir: Path
    url: str
    index: int  # worker index (rollout.workers of them)
    config: Config
    run_name: str
    name: str  # producer "rollout:<index>"
    env: Env
    blobs: BlobBackend
    gate: AsyncGate  # when the next group may start
    calls: ToolCalls  # runs env.respond off the event loop, bounded and timed
    # Set when run() starts.
    publisher: Publisher | None
    redis: redis.asyncio.Redis  # set by run(): publishing and reading the seq marks
    seq_base: int  # the producer's first seq in this process; part of group ids and seeds
    engine: Engine | None  # made when the first weights arrive (their config is in the run's init/)
    # Progress, changed only on the event loop.
    committed: int  # newest committed policy version (0 before any commit)
    refused: int  # newest policy version that could not be loaded (dead-lettered), -1 if none
    started: int  # groups started by this process
    draws: Draws  # the run's draw index of each group's prompt (a dataset's epochs; producers/draws.py)
    published: int  # groups published by this process
    dead_lettered: int  # groups dead-lettered (a reward that failed or is not finite, a non-finite logprob); each replaced
    in_flight: dict[str, asyncio.Task[None]]
    abandoned: list[str]
    heartbeat: Heartbeat  # what it does, for the launcher's liveness check (runtime/heartbeat.py)

    def __init__(self, run_dir: Path, url: str, index: int, config: Config):
        self.run_dir = Path(run_dir)
        self.url = url
        self.index = index
        self.config = config
        self.run_name = config.run.name
        self.name = f"rollout:{index}"
        self.env = env_for(config)
        self.blobs = run_blobs(self.run_dir, config)
        r = config.rollout
        self.gate = AsyncGate(config.trainer.batch_groups, r.workers, r.async_level, index)
        self.calls = ToolCalls.from_section(r)
        self.publisher = None
        self.seq_base = 0
        self.engine = None
        self.committed = 0
        self.refused = -1
        self.started = 0
        self.draws = Draws(index, r.workers)
        self.published = 0
        self.dead_lettered = 0
        self.in_flight = {}
        self.abandoned = []
        self._changed = asyncio.Event()  # set whenever a gate condition may have changed
        self._steps_read = False  # the steps stream has been read up to its end once
        self._background: list[asyncio.Task[None]] = []
        self._publishing: set[str] = set()  # groups whose events are being sent: never cancelled
        self._failures: list[BaseException] = []
        self._split = TimeSplit()  # where the wall time goes: engine busy, tool wait, idle
        self._swaps: list[float] = []  # weight swap seconds since the last WorkerStats
        self._marks = SeqMarks(self.run_name, config.bus.partitions)  # producers' published ranges
        self.heartbeat = Heartbeat(self.run_dir / "roles" / f"rollout-{index}{BEAT_SUFFIX}")

    async def run(self, stop: asyncio.Event) -> None:
        redis = self.redis = connect(self.url)
        try:
            self.seq_base = await self._recover_seq(redis)
            if self.env.counts_draws:  # this worker's draws so far, so a dataset's epochs go on where they were
                made = await recover_draws(redis, self.run_dir, self.run_name, self.name,
                                           worker_partition(self.index, self.config.bus.partitions))
                self.draws = Draws(self.index, self.config.rollout.workers, made)
            # Redis may have lost the newest commits (its last second) while the log kept them: a
            # gate on the bus alone would wait for versions the trainer will never commit again.
            self.committed = await asyncio.to_thread(newest_logged_commit, self.run_dir)
            # Its partition's lanes share one hash tag, so publish_atomic stays in one cluster slot.
            self.publisher = Publisher(redis, self.run_name, self.name, self.seq_base,
                                       worker_partition(self.index, self.config.bus.partitions))
            self._background = [asyncio.create_task(self._follow_weights(), name="follow-weights"),
                                asyncio.create_task(self._follow_steps(), name="follow-steps"),
                                asyncio.create_task(self._report_stats(), name="worker-stats")]
            log.info("%s starts (seq %d); waiting for policy version 0", self.name, self.seq_base)
            while not stop.is_set() and not self._ready():
                await self._wait(stop)
            if self._ready():
                await self.gate.recover(redis, self.run_dir, self.run_name, self.name,
                                        worker_partition(self.index, self.config.bus.partitions))
            while not stop.is_set():
                if self._may_start():
                    self._start_group()
                else:
                    await self._wait(stop)
            await self._drain()
        finally:
            await self._stop_groups()  # none are left unless run() failed
            for task in self._background:
                task.cancel()
            # Bounded: a watcher blocked in a read must not keep the worker from stopping.
            await asyncio.wait(self._background, timeout=DRAIN_TIMEOUT_S)
            if self.engine is not None:
                await self.engine.close()
            self.calls.close()
            await asyncio.shield(redis.aclose())
        log.info("%s stopped: %d groups published, %d abandoned", self.name, self.published, len(self.abandoned))

    # ---- gate ---------------------------------------------------------------------------------

    def _ready(self) -> bool:
        return self.engine is not None and self.engine.version >= 0 and self._steps_read

    def _gate_version(self) -> int:
        """c of the async gate: committed and live here (or refused: the worker goes on with what it has,
        and its samples name the version they really came from)."""
        return min(self.committed, self._held_version())

    def _may_start(self) -> bool:
        return (len(self.in_flight) < self.config.rollout.concurrency
                and self.gate.allows(self.started - self.dead_lettered, self._gate_version()))

    async def _wait(self, stop: asyncio.Event) -> None:
        """Until stop, a gate change or a background failure (which is raised here)."""
        self._changed.clear()
        if self.in_flight:
            self.heartbeat.alive("generating", f"{len(self.in_flight)} groups in flight, {self.published} published")
        else:  # the gate is closed: the trainer's next commit opens it
            self.heartbeat.alive("waiting for the trainer", f"{self.published} groups published", waiting=True)
        waiters = [asyncio.create_task(stop.wait()), asyncio.create_task(self._changed.wait())]
        try:
            await asyncio.wait([*waiters, *self._background], timeout=1.0, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waiters:
                w.cancel()
        for task in self._background:
            if task.done():
                task.result()  # raises the task's error
                raise RuntimeError(f"{task.get_name()} of {self.name} stopped unexpectedly")
        if self._failures:
            raise self._failures[0]

    # ---- groups -------------------------------------------------------------------------------

    def _start_group(self) -> None:
        counter = self.started
        group_id = f"{self.index}-{self.seq_base}-{counter}"
        seed = group_seed(self.config.run.seed, self.index, self.seq_base, counter)
        self.started += 1
        task = asyncio.create_task(self._group(group_id, seed, self.draws.next()), name=f"group-{group_id}")
        self.in_flight[group_id] = task
        self._split.groups_in_flight(len(self.in_flight))
        task.add_done_callback(lambda t: self._group_done(group_id, t))

    def _group_done(self, group_id: str, task: asyncio.Task[None]) -> None:
        del self.in_flight[group_id]
        self._split.groups_in_flight(len(self.in_flight))
        if not task.cancelled() and task.exception() is not None:
            log.error("%s: group %s failed: %r", self.name, group_id, task.exception())  # now, not at the end
            self._failures.append(task.exception())
        self._changed.set()

    async def _group(self, group_id: str, seed: int, draw: int) -> None:
        r = self.config.rollout
        prompt = self.env.draw(random.Random(seed), draw, self.config.run.seed)
        params = SamplingParams(n=r.group_size, temperature=r.temperature, top_p=r.top_p, max_tokens=r.max_tokens,
                                stop_token_ids=self.env.tokenizer.stop_ids, seed=seed)
        started = time.monotonic()
        try:
            episodes = await run_group(self.engine, self.env, prompt, params, self.calls, self._split)
        except RewardError as exc:  # the user's reward failed on a sample: that group is dropped, the run goes on
            await self.publisher.dead_letter(self.publisher.stamp(
                Trajectory, group_id=group_id, env=self.env.name, samples=[], worker=self.name, meta=prompt.meta,
                prompt=Tensor.from_numpy(np.asarray(prompt.ids, np.int32)), temperature=r.temperature), str(exc))
            self.dead_lettered += 1
            return
        generate_s = time.monotonic() - started
        experts = [Tensor.from_numpy(e.routing) for e in episodes]
        blob = None
        if sum(len(t.data) for t in experts) > ROUTING_INLINE_BYTES:
            blob = await asyncio.to_thread(lambda: self.blobs.put(pack(msgspec.msgpack.encode(experts))))
        trajectory = self.publisher.stamp(
            Trajectory, group_id=group_id, env=self.env.name,
            prompt=Tensor.from_numpy(np.asarray(prompt.ids, np.int32)), samples=[e.sample() for e in episodes], worker=self.name, meta=prompt.meta,
            temperature=r.temperature, generate_s=generate_s)
        problem = non_finite(episodes)
        if problem is not None:  # the round gets a replacement group, so the trainer's batch still fills
            self.dead_lettered += 1
            await self.publisher.dead_letter(trajectory, f"group {group_id} refused: {problem}")
            return
        trace = (self.publisher.stamp(RoutingTrace, group_id=group_id, blob=blob) if blob is not None
                 else self.publisher.stamp(RoutingTrace, group_id=group_id, experts=experts))
        self._publishing.add(group_id)
        try:
            await self.publisher.publish_atomic([trajectory, trace])
        finally:
            self._publishing.discard(group_id)
        self.published += 1
        self.heartbeat.progress("generating", f"{self.published} groups published")

    async def _drain(self) -> None:
        if self.in_flight:
            log.info("%s stopping: waiting up to %.0f s for %d groups in flight", self.name, DRAIN_TIMEOUT_S,
                     len(self.in_flight))
            await asyncio.wait(list(self.in_flight.values()), timeout=DRAIN_TIMEOUT_S)
        unfinished = await self._stop_groups()
        self.abandoned += unfinished
        if unfinished:
            log.warning("%s abandoned %d unfinished groups (not published): %s", self.name, len(unfinished),
                        ", ".join(unfinished))
        for error in self._failures:
            log.error("%s: a group failed: %s", self.name, error)

    async def _stop_groups(self) -> list[str]:
        """Cancel the groups still generating; let those already publishing finish.

        Cutting a publish short could drop the connection between the two XADDs of a group and
        leave a Trajectory without its RoutingTrace, so a publish is bounded only by its socket timeout.
        """
        generating = [g for g in self.in_flight if g not in self._publishing]
        for group_id in generating:
            self.in_flight[group_id].cancel()
        if self.in_flight:
            await asyncio.wait(list(self.in_flight.values()), timeout=DRAIN_TIMEOUT_S)
        return generating

    # ---- background ---------------------------------------------------------------------------

    async def _follow_weights(self) -> None:
        async with Tail(self.url, self.run_name, ["weights"], start="0") as tail:
            while True:
                entries = await self._trusted(await _entries_to_end(tail, block_ms=1000))
                latest = max((entry for entry in entries if isinstance(entry[2], WeightsPublished)),
                             key=lambda entry: entry[2].version, default=None)
                if latest is None or (self.engine is not None and latest[2].version <= self._held_version()):
                    continue
                lane, entry_id, event = latest
                if self.engine is None:
                    model_dir = init_dir(self.run_dir)  # the trainer wrote it before publishing version 0
                    self.engine = await asyncio.to_thread(make_engine, self.config, model_dir, self.blobs,
                                                          self.index)
                    await self.engine.start()
                started = time.monotonic()
                try:
                    await self.engine.update_weights(await self._weights_of(event), event.version, ref=event.weights)
                except WeightLoadError as exc:  # the engine keeps serving the version it has
                    self.refused = event.version
                    await dead_letter_read(self.publisher.redis, self.run_name, lane, entry_id, event,
                                           f"policy version {event.version} not loaded: {exc}", self.name)
                    self._changed.set()
                    continue
                self._swaps.append(time.monotonic() - started)
                log.info("%s: policy version %d live (%.2f s)", self.name, event.version, self._swaps[-1])
                self._changed.set()

    async def _weights_of(self, event: WeightsPublished) -> BlobRef | WeightManifest:
        """What the engine loads: the one blob, or the manifest of shards (read and verified here)."""
        return await asyncio.to_thread(engine_weights, self.blobs, event.weights, event.format)

    def _held_version(self) -> int:
        """The newest version this worker has dealt with: live in the engine, or refused as unloadable."""
        return max(self.engine.version, self.refused)

    async def _follow_steps(self) -> None:
        async with Tail(self.url, self.run_name, ["steps"], start="0") as tail:
            while True:
                entries = await self._trusted(await _entries_to_end(tail, block_ms=1000 if self._steps_read else 0))
                for _, _, event in entries:
                    if isinstance(event, (StepCommitted, GroupsDropped)):
                        self.gate.learn(event)
                commits = [event for _, _, event in entries if isinstance(event, StepCommitted)]
                self.committed = max([self.committed, *(c.version for c in commits)])
                self._steps_read = True
                self._changed.set()

    async def _trusted(self, entries: list[tuple[str, str, AnyEvent]]) -> list[tuple[str, str, AnyEvent]]:
        """What the trainer published, not what anyone wrote to its streams (bus/trust.py)."""
        kept = await trusted(self.redis, self.run_name, self._marks,
                             [(f"entry {entry_id} of {lane}", event) for lane, entry_id, event in entries])
        kept_ids = {id(event) for event in kept}
        return [entry for entry in entries if id(entry[2]) in kept_ids]

    async def _report_stats(self) -> None:
        while True:
            await asyncio.sleep(self.config.rollout.stats_every_s)
            if self.engine is None:
                continue
            share = self._split.idle_share()
            s = self.engine.stats()
            _, tool_wait, idle = self._split.totals()
            swaps, self._swaps = self._swaps, []
            await self.publisher.publish([self.publisher.stamp(
                WorkerStats, worker=self.name, tokens_per_s=s.tokens_per_s, running=s.running, waiting=s.waiting,
                policy_version=s.version, groups_published=self.published, idle_share=share,
                decode_steps=s.steps, decode_tokens=s.generated_tokens, forward_tokens=s.forward_tokens,
                busy_s=s.busy_s, decode_batches=list(s.batches), swap_s=swaps,
                version_spans_assumed=s.version_spans_assumed,
                cpu_s=time.process_time(), tool_wait_s=tool_wait, idle_s=idle, cpus=cpus())])

    async def _recover_seq(self, redis) -> int:
        # Entries the archiver made durable may be trimmed from the bus; the log still has them.
        return await recover_seq(redis, self.run_dir, self.run_name, self.name, _PUBLISHED_STREAMS,
                                 self.config.bus.partitions)


async def _entries_to_end(tail: Tail, block_ms: int) -> list[tuple[str, str, AnyEvent]]:
    """(lane, entry id, event) up to the stream's current end (a full batch means more are waiting)."""
    batch = await tail.read(count=_READ, block_ms=block_ms)
    entries = list(batch)
    while len(batch) == _READ:
        batch = await tail.read(count=_READ, block_ms=0)
        entries += batch
    return entries


def main(run_dir: Path, bus_url: str, worker: int) -> int:
    """`reel role rollout`: run worker `worker` of the run in `run_dir` until SIGTERM/SIGINT."""
    config = load(Path(run_dir) / "config.toml")
    logging.basicConfig(level=config.log.level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # else a line per vLLM request
    import torch

    torch.set_num_threads(int(os.environ.get("REEL_TORCH_THREADS", "1")))
    rollout = RolloutWorker(Path(run_dir), bus_url, worker, config)

    serve(rollout.run)
    return 0
