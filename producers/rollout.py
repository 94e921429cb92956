"""Rollout worker: prompts from the env through the engine, out as Trajectory + RoutingTrace events.

    wait for policy version 0 (the `weights` stream) and for the `steps` stream to be read
    loop: wait for room (concurrency, async gate) -> start a group
          a group: seeded prompt -> episodes (producers/episode.py: engine turns, env turns) -> rewards ->
                   one Publisher.publish_atomic([Trajectory, RoutingTrace]) (MULTI: both or neither)
    background: newest WeightsPublished -> fetch + verify the blob -> engine.update_weights (in place,
                between two decode steps); StepCommitted -> last committed version; WorkerStats
    stop: start nothing new, finish in-flight groups for up to DRAIN_TIMEOUT_S, log the rest as
          abandoned (a partial group is never published)

Async gate (rollout.async_level = a). Let c be the newest policy version that is both committed
(the `version` of the newest StepCommitted; 0 before any commit, version 0 being the initial
policy) and live in this worker's engine: a commit counts once its weights are loaded here, so no
round is sampled under weights older than the gate assumes. A worker splits its groups into rounds
of R = ceil(trainer.batch_groups / rollout.workers) groups, R being its share of one trainer batch
(with concurrency below R, a round takes several waves: were R capped at concurrency, each commit
would release fewer groups than the next step needs, and the run would stall); round r is meant for the step that turns version r into r + 1. Its
g-th group (counting from 0 in this process) belongs to round r(g) = c0 + (q + g) // R, c0 being c when
the process started its first group and q the groups of this worker an earlier process published
that the trainer has yet to train (producers/outstanding.py: they fill the next batches first),
and may start only when

    r(g) - c <= a.

So a = 0 is synchronous: one batch share under version c, then nothing until version c + 1 is
committed and loaded; a = 1 lets a worker generate the next round while the trainer computes the
current one. Either way at most `concurrency` groups are in flight. A restarted worker continues
the rounds its queued groups started, at the current c.

Identity: producer "rollout:<worker>"; its next seq is recovered from the bus and the run's log,
so a restart never reuses one; group ids are "<worker>-<seq base>-<counter>" with the seq base of
this process, unique across restarts. A group's prompt rng and sample seeds derive from
(run.seed, worker, seq base, counter).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import math
import os
import random
import signal
import time
from pathlib import Path

import msgspec
import numpy as np
import redis.asyncio

from reel.bus.blobs import BlobBackend
from reel.bus.events import (AnyEvent, BlobRef, RoutingTrace, Sample, StepCommitted, Tensor, Trajectory, WeightsPublished,
                             WorkerStats)
from reel.bus.log import LogError, RunLog
from reel.bus.logcodec import pack
from reel.bus.partitions import worker_partition
from reel.bus.seqs import recover_seq
from reel.bus.streams import Publisher, connect
from reel.bus.tail import Tail, dead_letter_read
from reel.bus.trust import SeqMarks, trusted
from reel.bus.weight_manifest import WeightManifest
from reel.producers.draws import Draws, recover_draws
from reel.producers.engine import Engine, EngineError, SamplingParams
from reel.producers.envs import Env, env_for
from reel.producers.episode import Episode, non_finite, run_group
from reel.producers.outstanding import outstanding_groups
from reel.producers.envs.rewards import RewardError
from reel.runtime.blob_store import run_blobs
from reel.runtime.config.sections import Config
from reel.runtime.config.run import load
from reel.runtime.heartbeat import BEAT_SUFFIX, Heartbeat
from reel.runtime.train.initial_policy import init_dir
from reel.runtime.weights.load import WeightLoadError, engine_weights

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
    round_size: int  # R of the async gate (module docstring)
    # Set when run() starts.
    publisher: Publisher | None
    redis: redis.asyncio.Redis  # set by run(): publishing and reading the seq marks
    seq_base: int  # the producer's first seq in this process; part of group ids and seeds
    engine: Engine | None  # made when the first weights arrive (their config is in the run's init/)
    # Progress, changed only on the event loop.
    committed: int  # newest committed policy version (0 before any commit)
    refused: int  # newest policy version that could not be loaded (dead-lettered), -1 if none
    first_round: int  # c0 of the async gate: c when this process started its first group
    queued: int  # q of the async gate: groups an earlier process published, not yet trained
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
        self.round_size = math.ceil(config.trainer.batch_groups / r.workers)
        self.publisher = None
        self.seq_base = 0
        self.engine = None
        self.committed = 0
        self.refused = -1
        self.first_round = 0
        self.queued = 0
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
        self._idle_since: float | None = time.monotonic()  # no group in flight since then
        self._idle_s = 0.0  # idle seconds since the last WorkerStats
        self._stats_at = time.monotonic()
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
                await self._count_queued(redis)
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
            await asyncio.shield(redis.aclose())
        log.info("%s stopped: %d groups published, %d abandoned", self.name, self.published, len(self.abandoned))

    # ---- gate ---------------------------------------------------------------------------------

    def _ready(self) -> bool:
        return self.engine is not None and self.engine.version >= 0 and self._steps_read

    def _gate_version(self) -> int:
        """c of the async gate: committed and live here (or refused: the worker goes on with what it has,
        and its samples name the version they really came from)."""
        return min(self.committed, self._held_version())

    async def _count_queued(self, redis) -> None:
        """c0 and q of the async gate, from one snapshot of the commits."""
        partition = worker_partition(self.index, self.config.bus.partitions)
        snapshot = await outstanding_groups(redis, self.run_dir, self.run_name, self.name, partition)
        self.first_round = snapshot.version
        self.queued = snapshot.groups
        if self.queued:
            log.info("%s: %d groups of an earlier run of this worker are still queued for the trainer; "
                     "counted in rounds from version %d", self.name, self.queued, self.first_round)

    def _may_start(self) -> bool:
        round_ = self.first_round + (self.queued + self.started - self.dead_lettered) // self.round_size
        return (len(self.in_flight) < self.config.rollout.concurrency
                and round_ - self._gate_version() <= self.config.rollout.async_level)

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
        if not self.in_flight and self._idle_since is not None:
            self._idle_s += time.monotonic() - self._idle_since
            self._idle_since = None
        task = asyncio.create_task(self._group(group_id, seed, self.draws.next()), name=f"group-{group_id}")
        self.in_flight[group_id] = task
        task.add_done_callback(lambda t: self._group_done(group_id, t))

    def _group_done(self, group_id: str, task: asyncio.Task[None]) -> None:
        del self.in_flight[group_id]
        if not self.in_flight:
            self._idle_since = time.monotonic()
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
            episodes = await run_group(self.engine, self.env, prompt, params)
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
            prompt=Tensor.from_numpy(np.asarray(prompt.ids, np.int32)), samples=[_sample(e) for e in episodes], worker=self.name, meta=prompt.meta,
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
                events = [event for _, _, event in entries]
                versions = [e.version for e in events if isinstance(e, StepCommitted)]
                self.committed = max([self.committed, *versions])
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
            now = time.monotonic()
            idle = self._idle_s + (now - self._idle_since if self._idle_since is not None else 0.0)
            share = min(1.0, idle / max(now - self._stats_at, 1e-9))
            self._idle_s, self._stats_at = 0.0, now
            if self._idle_since is not None:
                self._idle_since = now
            s = self.engine.stats()
            swaps, self._swaps = self._swaps, []
            await self.publisher.publish([self.publisher.stamp(
                WorkerStats, worker=self.name, tokens_per_s=s.tokens_per_s, running=s.running, waiting=s.waiting,
                policy_version=s.version, groups_published=self.published, idle_share=share,
                decode_steps=s.steps, decode_tokens=s.generated_tokens, forward_tokens=s.forward_tokens,
                busy_s=s.busy_s, swap_s=swaps, version_spans_assumed=s.version_spans_assumed,
                cpu_s=time.process_time())])

    async def _recover_seq(self, redis) -> int:
        # Entries the archiver made durable may be trimmed from the bus; the log still has them.
        return await recover_seq(redis, self.run_dir, self.run_name, self.name, _PUBLISHED_STREAMS,
                                 self.config.bus.partitions)


def _sample(e: Episode) -> Sample:
    return Sample(tokens=Tensor.from_numpy(np.asarray(e.tokens, np.int32)),
                  logprobs=Tensor.from_numpy(np.asarray(e.logprobs, np.float32)), reward=e.reward,
                  finish_reason=e.finish_reason, seed=e.seed, spans=e.spans, generate_s=e.seconds, env_spans=e.env_spans,
                  turns=len(e.turn_lengths), tool_calls=e.tool_calls, turn_lengths=e.turn_lengths,
                  scores=e.scores)


async def _entries_to_end(tail: Tail, block_ms: int) -> list[tuple[str, str, AnyEvent]]:
    """(lane, entry id, event) up to the stream's current end (a full batch means more are waiting)."""
    batch = await tail.read(count=_READ, block_ms=block_ms)
    entries = list(batch)
    while len(batch) == _READ:
        batch = await tail.read(count=_READ, block_ms=0)
        entries += batch
    return entries


def newest_logged_commit(run_dir: Path) -> int:
    """Version of the newest StepCommitted in the run's log (0 if none)."""
    try:
        with RunLog(run_dir, readonly=True) as run_log:
            if "steps" not in run_log.names():
                return 0
            return max((e.version for _, e in run_log.events("steps") if isinstance(e, StepCommitted)), default=0)
    except LogError:
        return 0  # no log yet


def group_seed(run_seed: int, worker: int, seq_base: int, counter: int) -> int:
    """A 63-bit seed for one group's prompt and samples (sample i uses seed + i)."""
    digest = hashlib.sha256(f"reel-group:{run_seed}:{worker}:{seq_base}:{counter}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 2


def make_engine(config: Config, model_dir: Path, blobs: BlobBackend, worker: int = 0) -> Engine:
    """The configured engine for the model in `model_dir` (HF layout); version -1 until weights arrive.

    vLLM runs as `vllm serve` servers reached over HTTP when REEL_VLLM_URL is set (the Slurm job's
    pools, or the one `reel run` starts), else in this process (engine.vllm_server = "inprocess").
    The servers are shared, so only worker 0 pushes weights to them.
    """
    e = config.engine
    if e.kind == "vllm" and os.environ.get("REEL_VLLM_URL"):
        from reel.producers.vllm_http import VLLMHTTPEngine

        url = os.environ["REEL_VLLM_URL"]
        servers = [s for s in os.environ.get("REEL_VLLM_SERVERS", "").split(",") if s]
        return VLLMHTTPEngine(model_dir, url=url, servers=servers, max_batch=e.max_batch, blobs=blobs, version=-1,
                              routed_experts=config.trainer.router_replay, push_weights=worker == 0)
    if e.kind == "vllm" and e.vllm_server == "local":
        raise EngineError("engine.vllm_server = \"local\" serves through the `vllm serve` that `reel run` starts; "
                          "a rollout role started by hand needs REEL_VLLM_URL (the server's http://host:port)")
    if e.kind == "vllm":
        from reel.producers.vllm import VLLMEngine

        return VLLMEngine(model_dir, max_batch=e.max_batch, max_seq_len=e.max_seq_len, precision=e.precision,
                          tensor_parallel_size=e.tensor_parallel_size, data_parallel_size=e.data_parallel_size,
                          expert_parallel=e.expert_parallel, blobs=blobs, version=-1,
                          routed_experts=config.trainer.router_replay)
    from reel.producers.builtin_engine import BuiltinEngine
    from reel.runtime.model.config import MoEConfig
    from reel.runtime.model.model import MoEModel

    model = MoEModel(MoEConfig.from_hf_dict(json.loads((model_dir / "config.json").read_text())), e.precision)
    return BuiltinEngine(model, max_batch=e.max_batch, max_seq_len=e.max_seq_len, blobs=blobs, version=-1,
                         threads=e.threads)


def main(run_dir: Path, bus_url: str, worker: int) -> int:
    """`reel role rollout`: run worker `worker` of the run in `run_dir` until SIGTERM/SIGINT."""
    config = load(Path(run_dir) / "config.toml")
    logging.basicConfig(level=config.log.level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # else a line per vLLM request
    import torch

    torch.set_num_threads(int(os.environ.get("REEL_TORCH_THREADS", "1")))
    rollout = RolloutWorker(Path(run_dir), bus_url, worker, config)

    async def serve() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await rollout.run(stop)

    import uvloop

    uvloop.run(serve())
    return 0
