"""A discrete-event simulation of a Reel pipeline, driven by a workload measured on a real run.

    rollout worker  an engine with continuous batching: at most `max_batch` sequences decode one
                    token per step, a step with B of them taking step_s(B, X) / speedup_rollout,
                    X the prompt tokens of sequences joining in it (they join between steps). The async gate of producers/rollout.py decides
                    when a group may start: round r(g) = c0 + g // R may start while r(g) - c <= a,
                    c = the newest version both committed and live in this worker's engine, g counting
                    kept groups only: one the trainer drops is replaced at once (GroupsDropped).
    episodes        a multi-turn sample (producers/episode.py) is one engine request per model turn:
                    when a turn ends, the env answers after the wall time its call took in the log
                    (Sample.env_s: a tool's wait, which holds up only that episode: producers/tool_calls.py),
                    its tokens are appended and the whole conversation so far
                    (prompt, earlier turns) is the next request's prompt, queued for a KV slot behind
                    the sequences already waiting and prefilled when it joins (the built-in engine
                    shares no prefix between requests). The group is done when every episode is.
    weight swap     after a commit each worker loads the new weights at its next step boundary;
                    decoding pauses for swap_s. Tokens carry the version that sampled them.
    Redis           one thread: a finished group's two events (Trajectory, RoutingTrace) occupy it
                    2 x redis_s_per_event (`reel bench bus` measures that cost) before the trainer sees them.
    trainer         takes arrived groups in order, drops those with a token older than
                    max_off_policy versions (consumers/trainer.py), computes once batch_groups are
                    in, then publishes. Compute = (base + per_token · tokens + per_position · padded
                    positions + per_score · attention scores of the batch's rows) / speedup_trainer,
                    rescaled from the logged world size to trainer_ranks, N ranks counting as N x rank_efficiency
                    times one (1 rank as 1): the FSDP trainer is
                    modelled as compute scaling with a stated efficiency, not simulated collective by
                    collective.
    shared cores    unless `dedicated`, a decode step that starts while the trainer computes, and a
                    trainer's compute while workers decode (re-timed whenever how many decode
                    changes), are slowed by what a machine shared by both roles costs: the processor-sharing model of the log's CPU times
                    for the scenario's worker count (replay/simulate_cores.py), else the factors
                    fitted on the log's overlap (replay/workload.py). With that model, each role's
                    measured speed is also rescaled from the logged machine to the scenario's: its
                    worker count, and `background` (other runnable threads) when given. Roles pinned to
                    disjoint cores (their logged affinities) do not slow each other.
    mismatch role   after each due commit the role splits that step: a job of the seconds alone the log's
                    splits give for its passes (π_old and each older version among its tokens) and tokens
                    (replay/simulate_split.py), one at a time, its pace re-timed like the trainer's as
                    workers start and stop decoding beside it; while one runs, decode steps starting and
                    the trainer's compute are slowed as far as the role shares their cores (unless `dedicated`).

Figures are those of `reel bench async`: wall time and idle shares over steps 2..N.
"""

from __future__ import annotations

import collections
import heapq
import itertools

import msgspec
import numpy as np

from reel.bus.errors import ReelError
from reel.replay.simulate_cores import Factors, factors
from reel.replay.simulate_parts import (Group, Paced, Sequence, SimResult, Worker, bottleneck, clip_length,
                                        mean_result)
from reel.replay.simulate_split import passes
from reel.replay.workload import Pipeline, Workload
from reel.runtime.train.batch import padded_work

__all__ = ["Scenario", "SimResult", "SimulationError", "simulate", "GROUP_EVENTS"]

GROUP_EVENTS = 2  # a finished group is one Trajectory and one RoutingTrace on the bus


class SimulationError(ReelError):
    """A scenario that cannot run (e.g. a gate that can never open); the message names the setting."""


class Scenario(msgspec.Struct, kw_only=True):
    pipeline: Pipeline
    speedup_rollout: float = 1.0  # decode steps this many times faster than measured
    speedup_trainer: float = 1.0  # trainer compute this many times faster than measured
    rank_efficiency: float = 0.9  # trainer compute scales as ranks x this (ranks > 1)
    rank_efficiency_source: str = ""  # where rank_efficiency came from (replay/rank_efficiency.py)
    redis_s_per_event: float = 0.0  # Redis CPU seconds per event (`reel bench bus`)
    dedicated: bool = False  # rollout and trainer on their own hardware: no shared-core slowdown
    background: float | None = None  # other runnable threads on the machine (a log with CPU times); None: as logged
    seed: int = 0  # of the group resampling
    repeats: int = 8  # runs with seeds seed, seed + 1, ...: their mean (one draw of groups is noisy)


class _Simulation:
    # Fixed at construction.
    workload: Workload
    scenario: Scenario
    pipeline: Pipeline
    round_size: int  # R of the async gate
    factors: Factors  # what the scenario's machine does to the logged times
    rng: np.random.Generator
    # The clock and the pending events: (time, order of scheduling, kind, worker index, payload).
    now: float
    events: list[tuple[float, int, str, int, object]]
    workers: list[Worker]
    # Trainer.
    version: int  # committed steps
    queue: collections.deque[Group]  # arrived, not yet offered
    batch: list[Group]
    computing: bool  # computing or publishing
    compute: Paced  # the step's compute, while `computing` and before publishing
    step_started: float
    commits: list[tuple[float, float]]  # (time of the commit, seconds its step waited)
    staleness: dict[int, int]
    used: int
    dropped: int
    # The mismatch role: seconds alone of each split still to start; the running one's as the trainer's.
    splits: collections.deque[float]
    split: Paced  # the running split
    # Redis.
    redis_free: float  # when the Redis thread is next free
    redis_busy: list[tuple[float, float]]

    def __init__(self, workload: Workload, scenario: Scenario):
        self.workload = workload
        self.scenario = scenario
        self.pipeline = p = scenario.pipeline
        self.round_size = min(p.concurrency, -(-p.batch_groups // p.rollout_workers))
        self.rng = np.random.default_rng(scenario.seed)
        self.factors = Factors(workload.decode.shared_slowdown, workload.trainer.shared_slowdown) \
            if workload.cores is None else \
            factors(workload.cores, workload.pipeline.rollout_workers, p.rollout_workers, scenario.background)
        self.now = 0.0
        self.events = []
        self._order = itertools.count()
        self.workers = [Worker(i) for i in range(p.rollout_workers)]
        self.version = 0
        self.queue = collections.deque()
        self.batch = []
        self.computing = False
        self.compute = Paced()
        self.step_started = 0.0
        self.commits = []
        self.staleness = {}
        self.used = self.dropped = 0
        self.redis_free = 0.0
        self.redis_busy = []
        self.splits = collections.deque()
        self.split = Paced()

    # ---- the loop -------------------------------------------------------------------------------

    def run(self) -> SimResult:
        for worker in self.workers:
            self._fill(worker)
        while self.version < self.pipeline.steps:
            if not self.events:
                raise SimulationError(self._stuck())
            self.now, _, kind, index, payload = heapq.heappop(self.events)
            match kind:
                case "step":
                    self._step_done(self.workers[index])
                case "env":  # answers due at the same time all queue before the engine admits any
                    self._env_done(self.workers[index], payload)
                    self._at(0.0, "admit", index)
                case "admit":
                    self._fill(self.workers[index])
                case "swap":
                    self._swap_done(self.workers[index], version=int(payload))
                case "arrive":
                    self.queue.append(payload)
                    self._collect()
                case "computed" if payload == self.compute.timer:
                    self.compute.running = False
                    self._at(self.workload.trainer.publish_s * self.factors.trainer_scale, "commit")
                case "commit":
                    self._commit()
                case "split" if payload == self.split.timer:
                    self.split.running = False
                    self._next_split()
            self._retime()
        return self._result()

    def _at(self, delay: float, kind: str, index: int = 0, payload: object = None) -> None:
        heapq.heappush(self.events, (self.now + delay, next(self._order), kind, index, payload))

    # ---- rollout --------------------------------------------------------------------------------

    def _may_start(self, worker: Worker) -> bool:
        # c0 = 0: every worker starts with version 0 live; a dropped group is replaced (producers/async_gate.py)
        round_ = (worker.started - worker.replaced) // self.round_size
        gate = min(worker.committed, worker.version)
        return worker.in_flight < self.pipeline.concurrency and round_ - gate <= self.pipeline.async_level

    def _fill(self, worker: Worker) -> None:
        """Start every group the gate allows, then keep the engine going."""
        while self._may_start(worker):
            shape = self.workload.groups[int(self.rng.integers(len(self.workload.groups)))]
            group = Group(len(shape.samples), worker.index, shape.rows())
            waits = shape.env_s or [[] for _ in shape.samples]  # a log from before env_s: no tool waits
            worker.waiting.extend(Sequence(group, turns, shape.prompt, wait) for turns, wait in zip(shape.samples, waits))
            worker.started += 1
            worker.in_flight += 1
            if worker.idle_since is not None:
                worker.idle.append((worker.idle_since, self.now))
                worker.idle_since = None
        self._kick(worker)

    def _kick(self, worker: Worker) -> None:
        """Between two steps: swap in newer weights first, else admit and start a decode step."""
        if worker.busy:
            return
        if worker.version < self.version:
            worker.busy = True
            self._at(self.workload.swap_s, "swap", worker.index, self.version)
            return
        prefill = 0
        while worker.waiting and len(worker.running) < self.pipeline.max_batch:
            seq = worker.waiting.popleft()
            prefill += seq.prefill
            worker.running.append(seq)
        if not worker.running:
            return
        d = self.workload.decode
        seconds = (d.base_s + d.per_seq_s * len(worker.running) + d.per_prefill_token_s * prefill)
        seconds *= self.factors.decode_scale / self.scenario.speedup_rollout
        if not self.scenario.dedicated:
            f = self.factors
            seconds *= 1.0 + f.decode_slowdown * self.computing + f.decode_split * self.split.running
        worker.busy = True
        self._at(seconds, "step", worker.index)

    def _step_done(self, worker: Worker) -> None:
        worker.busy = False
        still = []
        for seq in worker.running:
            seq.group.sampled(worker.version, 1)
            seq.left -= 1
            if seq.left > 0:
                still.append(seq)
                continue
            wait = seq.env_wait()
            if wait > 0:  # the env's answer (a tool call) takes wall time; the engine goes on without it
                self._at(wait, "env", worker.index, seq)
            else:
                self._env_done(worker, seq)
        worker.running = still
        self._fill(worker)

    def _env_done(self, worker: Worker, seq: Sequence) -> None:
        """The env answered a finished model turn: the sample's next turn queues, or the sample is done."""
        if seq.next_turn():
            worker.waiting.append(seq)
            return
        seq.group.samples -= 1
        if seq.group.samples == 0:
            self._group_done(worker, seq.group)

    def _swap_done(self, worker: Worker, version: int) -> None:
        worker.busy = False
        worker.version = version
        self._fill(worker)

    def _group_done(self, worker: Worker, group: Group) -> None:
        worker.in_flight -= 1
        if worker.in_flight == 0:
            worker.idle_since = self.now
        cost = GROUP_EVENTS * self.scenario.redis_s_per_event
        start = max(self.now, self.redis_free)
        self.redis_free = start + cost
        if cost:
            self.redis_busy.append((start, self.redis_free))
        self._at(self.redis_free - self.now, "arrive", payload=group)

    # ---- trainer --------------------------------------------------------------------------------

    def _collect(self) -> None:
        """Offer arrived groups in order until the batch is full (consumers/trainer.py `_collect`)."""
        if self.computing or self.version >= self.pipeline.steps:
            return
        while self.queue and len(self.batch) < self.pipeline.batch_groups:
            group = self.queue.popleft()
            if self.version - group.oldest > self.pipeline.max_off_policy:
                self.dropped += 1
                self.workers[group.worker].replaced += 1  # the trainer announces it at once (GroupsDropped)
                self._fill(self.workers[group.worker])
            else:
                self.batch.append(group)
        if len(self.batch) < self.pipeline.batch_groups:
            return
        self.computing = True
        self.commits.append((0.0, self.now - self.step_started))  # the commit time is set by _commit
        t = self.workload.trainer
        tokens = sum(sum(g.tokens.values()) for g in self.batch)
        padded = padded_work([n for g in self.batch for n in g.rows], self.pipeline.micro_batch_tokens)
        seconds = (t.base_s + t.per_token_s * tokens + t.per_position_s * padded.positions
                   + t.per_score_s * padded.scores)
        seconds *= self.factors.trainer_scale / self.scenario.speedup_trainer
        # The fit is of the logged ranks' compute: rescale from those to the scenario's, not from one.
        seconds *= self._rank_speed(t.ranks) / self._rank_speed(self.pipeline.trainer_ranks)
        self.compute.start(seconds)
        self._retime()

    def _next_split(self) -> None:
        if self.split.running or not self.splits:
            return
        self.split.start(self.splits.popleft())
        self._retime()

    def _retime(self) -> None:
        """The trainer's compute and the running split go at the pace of what runs beside them."""
        if self.scenario.dedicated:
            trainer = split = 1.0
        else:
            f, decoding = self.factors, sum(1 for w in self.workers if w.running) / len(self.workers)
            trainer = 1.0 + f.trainer_slowdown * decoding + f.trainer_split * self.split.running
            split = 1.0 + f.split_decode * decoding + f.split_trainer * self.compute.running
        for work, factor, kind in ((self.compute, trainer, "computed"), (self.split, split, "split")):
            if work.running and (delay := work.retime(self.now, factor)) is not None:
                self._at(delay, kind, payload=work.timer)

    def _rank_speed(self, ranks: int) -> float:
        """Trainer throughput of `ranks` ranks relative to one process."""
        return 1.0 if ranks <= 1 else ranks * self.scenario.rank_efficiency

    def _commit(self) -> None:
        batch: dict[int, int] = {}  # versions behind -> tokens
        for group in self.batch:
            for version, tokens in group.tokens.items():
                batch[self.version - version] = batch.get(self.version - version, 0) + tokens
        for behind, tokens in batch.items():
            self.staleness[behind] = self.staleness.get(behind, 0) + tokens
        split = self.workload.split
        if split is not None and split.due(self.version + 1, self.pipeline.steps):
            self.splits.append(split.seconds(passes(batch), sum(batch.values())))
            self._next_split()
        self.used += len(self.batch)
        self.batch = []
        self.version += 1
        self.computing = False
        self.commits[-1] = (self.now, self.commits[-1][1])
        self.step_started = self.now
        for worker in self.workers:
            worker.committed = self.version
            self._fill(worker)
        self._collect()

    # ---- results --------------------------------------------------------------------------------

    def _result(self) -> SimResult:
        first, end = self.commits[0][0], self.commits[-1][0]
        wall = end - first
        waited = sum(w for _, w in self.commits[1:])
        idle = []
        for worker in self.workers:
            spans = worker.idle + ([(worker.idle_since, end)] if worker.idle_since is not None else [])
            idle.append(sum(clip_length(a, b, first, end) for a, b in spans) / wall if wall else 0.0)
        redis = sum(clip_length(a, b, first, end) for a, b in self.redis_busy) / wall if wall else 0.0
        trainer_idle = waited / wall if wall else 0.0
        rollout_idle = float(np.mean(idle))
        offered = self.used + self.dropped
        return SimResult(steps=len(self.commits), wall_s=wall,
                         steps_per_hour=3600 * (len(self.commits) - 1) / wall if wall else 0.0,
                         trainer_idle=trainer_idle, rollout_idle=rollout_idle,
                         staleness=dict(sorted(self.staleness.items())),
                         dropped_share=self.dropped / offered if offered else 0.0, redis_busy=redis,
                         bottleneck=bottleneck(trainer_idle, rollout_idle, redis))

    def _stuck(self) -> str:
        p = self.pipeline
        return (f"the simulated pipeline stalls before step {self.version + 1}: {p.rollout_workers} workers x "
                f"{self.round_size} groups per round cannot fill trainer.batch_groups = {p.batch_groups} at "
                f"async_level = {p.async_level}; raise rollout.concurrency or the number of workers")


def simulate(workload: Workload, scenario: Scenario) -> SimResult:
    """Run the scenario to `pipeline.steps` commits; needs at least 3 steps for steps 2..N figures."""
    p = scenario.pipeline
    if p.steps < 3:
        raise SimulationError(f"--steps = {p.steps}: simulate at least 3 steps (figures cover steps 2..N)")
    for name, value in (("rollout workers", p.rollout_workers), ("trainer ranks", p.trainer_ranks),
                        ("--speedup-rollout", scenario.speedup_rollout),
                        ("--speedup-trainer", scenario.speedup_trainer)):
        if value <= 0:
            raise SimulationError(f"{name} = {value} must be positive")
    if p.async_level < 0 or p.max_off_policy < 0:
        raise SimulationError("async level and max off-policy steps must be 0 or more")
    if not 0 < scenario.rank_efficiency <= 1:
        raise SimulationError(f"--rank-efficiency = {scenario.rank_efficiency} must be in (0, 1]")
    if scenario.background is not None and (scenario.background < 0 or workload.cores is None):
        raise SimulationError(f"--background = {scenario.background}: needs a value of 0 or more and a log with CPU "
                              f"times (recorded since 2026-12-03); {workload.run_dir} has "
                              f"{'them' if workload.cores else 'none'}")
    if scenario.repeats < 1:
        raise SimulationError(f"--repeats = {scenario.repeats} must be 1 or more")
    return mean_result([_Simulation(workload, msgspec.structs.replace(scenario, seed=scenario.seed + i)).run()
                        for i in range(scenario.repeats)])
