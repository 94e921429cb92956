"""Synthetic run logs for `reel simulate`'s tests: every time a constant of the model, so answers have closed forms.

Every sample has L tokens (or the turns given), a decode step takes A + B · running sequences + X ·
prefill tokens, the trainer's compute C0 + C1 · tokens, its publish PUBLISH, a weight swap SWAP;
with a Cores model the times and CPU seconds are those processor sharing gives (pinned apart when
its trainer has cores of its own: the log then has each role's affinity), and with `split` the
mismatch role's events price a split as base + passes · per-token · tokens.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from reel.bus.events import (MismatchSplit, RunStarted, Sample, StepCommitted, StepTiming, Tensor, Trajectory,
                             WorkerStats, encode)
from reel.bus.run_log import RunLog
from reel.replay.simulate_cores import Cores
from reel.runtime.config import run as config_mod

L, N, G, P = 6, 4, 4, 3  # tokens per sample, samples per group, groups per step, prompt tokens
A, B, X = 0.010, 0.0005, 0.0002  # decode step seconds: A + B · running sequences + X · prefill tokens
C0, C1 = 0.05, 0.001  # trainer compute seconds: C0 + C1 · tokens
PUBLISH, SWAP = 0.02, 0.004


def sample(turns: tuple[int, ...], env_s: tuple[float, ...] = ()) -> Sample:
    """A sample whose turns have these token counts: model, env, model, ... (env turns as env_spans),
    the env answering each model turn in env_s seconds."""
    env_spans = [(sum(turns[:i]), sum(turns[:i + 1])) for i in range(1, len(turns), 2)]
    n = sum(turns)
    return Sample(tokens=Tensor.from_numpy(np.zeros(n, np.int32)), logprobs=Tensor.from_numpy(np.zeros(n, np.float32)),
                  reward=0.0, finish_reason="length", seed=0, spans=[(0, 0)], env_spans=env_spans,
                  turns=len(env_spans) + 1, tool_calls=len(env_spans), turn_lengths=list(turns[::2]),
                  env_s=list(env_s))


def write_run(run_dir: Path, *, async_level: int, steps: int = 12, slowdown: float = 0.0,
              episodes: list[tuple[int, ...]] | None = None, world_size: int = 1, cores: Cores | None = None,
              env_s: tuple[float, ...] = (), split: tuple[float, float] | None = None, nice: int = 0,
              padded: tuple[float, float] | None = None, rounds: list[list[list[int]]] | None = None,
              around_s: float = 0.0, by_batch: bool = False, worker_stats: int = 12) -> Path:
    """A run directory whose log holds exactly the constants above (and `slowdown` while overlapping);
    every group's samples have the turns of `episodes` (default: N one-turn samples of L tokens).
    With `cores`, the log has CPU times and the times are those that processor sharing gives; pinned
    apart, the trainer logs core 0 as its affinity and the worker the others. With `split` = (base
    seconds, seconds of a scoring pass per token), the trainer's π_old scoring takes a pass and the
    mismatch role splits each step after its commit, one pass more for each older version
    (every even step has one), at CPU priority `nice`. With `padded` = (seconds per padded position,
    per attention score), group j's samples have L + j % 3 tokens, each commit names its batch's groups
    (`batch_of`) and the trainer's compute costs that much for their rows instead of C1 per token.
    With `rounds` (per round, per group, its samples' lengths), the trajectories are those rounds, run
    alone one after the other, each group taking what the decode constants give (`round_seconds`) and
    `around_s` more outside the engine (in its generate_s, as the reward and publishing are). With
    `by_batch`, the WorkerStats also time the steps by batch size (decode_batches), two of each
    interval's steps at a batch two sequences larger. The worker reports `worker_stats` times, 700 ms
    apart from 1.5 s on (the first commit is at 2 s)."""
    raw = {"run": {"name": "synthetic", "steps": steps},
           "rollout": {"workers": 1, "concurrency": G, "group_size": N, "async_level": async_level, "max_tokens": L},
           "trainer": {"batch_groups": G, "max_off_policy_steps": 8, "ranks": world_size}, "engine": {"max_batch": 64}}
    run_dir.mkdir()
    (run_dir / "config.toml").write_text(config_mod.to_toml(config_mod.from_dict(raw, source="test")))
    meta = {"run": "synthetic", "producer": "test"}
    # The worker always has a group in flight, so the trainer always computes beside it.
    trainer_share, decode_slowdown = 1.0, slowdown
    if cores is not None:
        trainer_share, decode_slowdown = cores.trainer_share(1), cores.decode_slowdown(1)
    trainer_cpus, worker_cpus = [], []
    if cores is not None and cores.apart:
        trainer_cpus, worker_cpus = [0], list(range(1, 1 + cores.cores))
    with RunLog(run_dir) as log:
        if cores is not None:
            log.stream("control").append_batch([("900-0", encode(RunStarted(
                **meta, seq=0, config_toml="", seed=0, code_version="", model_config={},
                cpu_count=len(trainer_cpus) or cores.cores, cpus=trainer_cpus)))])
        samples = [sample(turns, env_s) for turns in episodes or [(L,)] * N]
        lengths = [[sample((L + i % 3,))] * N if padded else samples for i in range(90)]
        # The worker always has a group in flight: one published every 100 ms, started 150 ms before (no
        # round runs alone: replay/decode_rounds.py finds none).
        published = [(1100 + 100 * i, lengths[i], 0.15) for i in range(90)]
        if rounds:  # one round a second from 1 s on
            published = [(1000 * (r + 1) + round(1000 * seconds), [sample((n,)) for n in group], seconds)
                         for r, round_ in enumerate(rounds)
                         for group, seconds in zip(round_, [s + around_s for s in round_seconds(round_)])]
        log.stream("trajectories").append_batch([
            (f"{ms}-{i}", encode(Trajectory(
                **meta, seq=i, group_id=f"g{i}", env="reverse_text", prompt=Tensor.from_numpy(np.zeros(P, np.int32)),
                samples=group, worker="rollout:0", generate_s=seconds)))
            for i, (ms, group, seconds) in enumerate(sorted(published, key=lambda p: p[0]))])
        # Steps of varying size, 1 s apart, computing in the first half of each second.
        commits, splits, now_ms = [], [], 1000
        for step in range(1, 9):
            tokens = 20 * step
            named = [f"g{j}" for j in batch_of(step)] if padded else []
            alone = compute_alone(step, padded)
            compute = alone * (1 + (cores.trainer_slowdown(1) if cores else 0.0))
            now_ms += 1000
            commits.append((f"{now_ms}-0", encode(StepCommitted(
                **meta, seq=step, step=step, version=step, groups=named, dropped=[], loss=0.0, grad_norm=0.0,
                weights_sha256="", timing=StepTiming(wait=1.0 - compute - PUBLISH, compute=compute, publish=PUBLISH,
                                                     score_old=split[1] * tokens if split else 0.0),
                metrics={"tokens": float(tokens)}, world_size=world_size, cpu_s=compute * trainer_share))))
            if split:
                versions = [step - 2] if step % 2 == 0 else []
                seconds = split[0] + (1 + len(versions)) * split[1] * tokens
                splits.append((f"{now_ms + round(1000 * seconds)}-0", encode(MismatchSplit(
                    **meta, seq=step, step=step, figures={}, versions=versions, compute_s=seconds, nice=nice))))
        log.stream("steps").append_batch(sorted(commits + splits, key=lambda e: int(e[0].split("-")[0])))
        # WorkerStats every 700 ms (so intervals overlap compute by varying shares), batch sizes varying.
        stats, steps_done, tokens_done, forward, busy, cpu = [], 0, 0, 0, 0.0, 1.0
        batches: dict[int, list[float]] = {}  # batch size -> [steps, prefilled tokens, seconds] since the start
        for i in range(worker_stats):
            ms = 1500 + 700 * i
            if i:
                batch = 4 + 3 * (i % 5)
                share = overlap_share(ms - 700, ms, cores, padded)
                count, prefill = 10 + i, 5 * (i % 3)
                for size, n in ([(batch, count - 2), (batch + 2, 2)] if by_batch else [(batch, count)]):
                    steps_done += n
                    tokens_done += n * size
                    forward += n * (size + prefill)
                    decoding = n * (A + B * size + X * prefill) * (1 + decode_slowdown * share)
                    busy += decoding
                    row = batches.setdefault(size, [0, 0, 0.0])
                    row[0], row[1], row[2] = row[0] + n, row[1] + n * prefill, row[2] + decoding
                    if cores is not None:  # the worker's threads run while its engine decodes
                        g = (1 - share) * cores.share(0, 1) + share * cores.share(1, 1)
                        cpu += cores.worker_threads * decoding * g
            stats.append((f"{ms}-0", encode(WorkerStats(
                **meta, seq=100 + i, worker="rollout:0", tokens_per_s=0.0, running=0, waiting=0, policy_version=0,
                groups_published=0, decode_steps=steps_done, decode_tokens=tokens_done, forward_tokens=forward, busy_s=busy,
                decode_batches=[(b, int(n), int(x), t) for b, (n, x, t) in sorted(batches.items())] if by_batch else [],
                swap_s=[SWAP], cpu_s=cpu if cores else 0.0, cpus=worker_cpus))))
        log.stream("control").append_batch(stats)
    return run_dir


def round_seconds(round_: list[list[int]]) -> list[float]:
    """Seconds each group of a round alone takes: a decode step at each of its longest sample's tokens,
    over the round's samples still running, the round's prompts prefilled in its first step."""
    lengths = [n for group in round_ for n in group]
    prefill = X * (P - 1) * len(lengths)
    return [prefill + sum(A + B * sum(1 for n in lengths if n > k) for k in range(max(group))) for group in round_]


def batch_of(step: int) -> range:
    """The groups a step with `padded` costs trains: 1 to 3, their rows P + L + j % 3 - 1 long."""
    return range(3 * step, 3 * step + 1 + step % 3)


def compute_alone(step: int, padded: tuple[float, float] | None = None) -> float:
    """The synthetic trainer's compute seconds of `step` alone: C0 + C1 per token of its 20 · step, or
    with `padded` C0 + the costs of its batch's padded positions and attention scores (one micro-batch:
    every row as long as the longest)."""
    if not padded:
        return C0 + C1 * 20 * step
    rows, longest = N * len(batch_of(step)), P + L + max(j % 3 for j in batch_of(step)) - 1
    return C0 + padded[0] * rows * longest + padded[1] * rows * longest ** 2


def overlap_share(start_ms: float, end_ms: float, cores: Cores | None = None,
                  padded: tuple[float, float] | None = None) -> float:
    """Share of [start, end] inside the synthetic trainer's compute intervals."""
    covered = 0.0
    for step in range(1, 9):
        end = 2000 + 1000 * (step - 1) - 1000 * PUBLISH
        begin = end - 1000 * compute_alone(step, padded) * (1 + (cores.trainer_slowdown(1) if cores else 0.0))
        covered += max(0.0, min(end, end_ms) - max(begin, start_ms))
    return covered / (end_ms - start_ms)
