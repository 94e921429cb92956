"""The rollout worker on a real Redis: groups out, weights in, the async gate, crash and restart."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from reel.bus.blob_backends.file import BlobStore
from reel.bus.events import (
    RoutingTrace, WorkerStats,
)
from faultproxy import FaultProxy
from reel.producers import rollout
from reel.producers.rollout import RolloutWorker
from reel.runtime.train.batch import decode_routing
from reel.runtime.config.run import load
from rollout_setup import announce_drops, initial_model, make_run, publish_weights, stream_events, wait_for

torch.set_num_threads(2)


async def _worker_on_version_0(redis_url: str, run_dir):
    """Rollout worker 0 of `run_dir` running as a task, version 0 of the policy published (not committed):
    (worker, the initial model, its stop event, its task)."""
    worker = RolloutWorker(run_dir, redis_url, 0, load(run_dir / "config.toml"))
    model = initial_model(run_dir)
    await publish_weights(redis_url, run_dir, 0, model, commit=False)
    stop = asyncio.Event()
    return worker, model, stop, asyncio.create_task(worker.run(stop))

async def test_worker_publishes_whole_groups_with_their_routing(redis_url: str, run_name: str, tmp_path) -> None:
    run_dir = make_run(tmp_path, run_name, async_level=1)
    worker = RolloutWorker(run_dir, redis_url, 0, load(run_dir / "config.toml"))
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    await asyncio.sleep(0.3)
    assert worker.started == 0  # no weights yet: nothing is generated
    await publish_weights(redis_url, run_dir, 0, initial_model(run_dir), commit=False)
    groups = await wait_for(redis_url, run_name, 4)
    await asyncio.sleep(0.3)
    stop.set()
    await asyncio.wait_for(task, 20)

    traces = {t.group_id: t for t in await stream_events(redis_url, run_name, "routing")}
    groups = await stream_events(redis_url, run_name, "trajectories")
    assert len(groups) == 4 == worker.published  # async_level 1, rounds of 2: two rounds before a commit
    assert len({g.group_id for g in groups}) == 4 and set(traces) == {g.group_id for g in groups}
    for group in groups:
        assert group.producer == "rollout:0" and group.worker == "rollout:0" and group.env == "reverse_text"
        assert traces[group.group_id].seq == group.seq + 1  # published together
        prompt = group.prompt.numpy()
        assert prompt.dtype == np.int32 and len(group.samples) == 3
        assert len({s.seed for s in group.samples}) == 3
        for sample, experts in zip(group.samples, traces[group.group_id].experts):
            tokens = sample.tokens.numpy()
            assert tokens.dtype == np.int32 and sample.logprobs.numpy().dtype == np.float32
            assert 1 <= len(tokens) <= 6 and len(sample.logprobs.numpy()) == len(tokens)
            assert sample.spans == [(0, 0)] and 0.0 <= sample.reward <= 1.0
            assert sample.finish_reason in ("stop", "length")
            assert experts.dtype == "uint8" and experts.shape == [len(prompt) + len(tokens) - 1, 2, 2]
    stats = [e for e in await stream_events(redis_url, run_name, "control") if isinstance(e, WorkerStats)]
    assert stats and stats[-1].worker == "rollout:0" and stats[-1].policy_version == 0
    assert stats[-1].cpus == sorted(os.sched_getaffinity(0))  # the cores it may run on (the simulator's pools)


@pytest.mark.parametrize("async_level", [0, 1])
async def test_async_gate(redis_url: str, run_name: str, tmp_path, async_level: int) -> None:
    run_dir = make_run(tmp_path, run_name, async_level=async_level, concurrency=4, batch_groups=2)
    worker = RolloutWorker(run_dir, redis_url, 0, load(run_dir / "config.toml"))
    assert worker.gate.round_size == 2  # the worker's share of a batch, below concurrency
    model = initial_model(run_dir)
    await publish_weights(redis_url, run_dir, 0, model, commit=False)
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    before_commit = 2 * (async_level + 1)
    await wait_for(redis_url, run_name, before_commit)
    await asyncio.sleep(0.5)
    assert worker.started == before_commit and not worker.in_flight  # waiting for a commit

    # New weights alone do not release the gate; their commit does.
    await publish_weights(redis_url, run_dir, 1, model, commit=False)
    await asyncio.sleep(0.5)
    assert worker.started == before_commit
    await publish_weights(redis_url, run_dir, 1, model, commit=True)
    groups = await wait_for(redis_url, run_name, before_commit + 2)
    await asyncio.sleep(0.5)
    assert worker.started == before_commit + 2
    stop.set()
    await asyncio.wait_for(task, 20)
    # The released round was sampled under version 1 (synchronous: on-policy for step 2).
    assert all(s.spans == [(0, 1)] for g in groups[before_commit:] for s in g.samples)


async def test_each_commit_releases_a_whole_batch_share(redis_url: str, run_name: str, tmp_path) -> None:
    """concurrency 2 < batch_groups 3: rounds still hold a whole batch, so commits never starve the trainer."""
    run_dir = make_run(tmp_path, run_name, async_level=1, concurrency=2, batch_groups=3, max_tokens=3)
    worker, model, stop, task = await _worker_on_version_0(redis_url, run_dir)
    await wait_for(redis_url, run_name, 6)  # two batches before any commit (async_level 1)
    await asyncio.sleep(0.5)
    assert worker.started == 6 and not worker.in_flight
    await publish_weights(redis_url, run_dir, 1, model, commit=True)
    await wait_for(redis_url, run_name, 9)  # one more batch per commit
    await asyncio.sleep(0.5)
    assert worker.started == 9
    stop.set()
    await asyncio.wait_for(task, 20)


async def test_a_group_the_trainer_drops_is_replaced(redis_url: str, run_name: str, tmp_path) -> None:
    """A stale group a commit drops leaves the trainer one short: the worker starts one more in its stead (another
    worker's drop is that worker's to replace), so the groups kept ahead of the trainer do not shrink as drops add up."""
    run_dir = make_run(tmp_path, run_name, async_level=1, concurrency=8, batch_groups=2, max_tokens=3)
    worker, model, stop, task = await _worker_on_version_0(redis_url, run_dir)
    groups = await wait_for(redis_url, run_name, 4)  # two rounds of 2 before any commit
    await asyncio.sleep(0.5)
    assert worker.started == 4 and not worker.in_flight
    # Version 1 trains one group and drops the other of round 0, and a group of worker 1.
    await publish_weights(redis_url, run_dir, 1, model, commit=True, dropped=[groups[0].group_id, "1-0-0"])
    await wait_for(redis_url, run_name, 7)
    await asyncio.sleep(0.5)
    assert worker.started == 7  # round 2 (2 groups) and the dropped group's replacement
    await publish_weights(redis_url, run_dir, 2, model, commit=True)
    await wait_for(redis_url, run_name, 9)
    await asyncio.sleep(0.5)
    assert worker.started == 9  # the replacement is not counted against later rounds
    stop.set()
    await asyncio.wait_for(task, 20)


async def test_a_drop_announced_before_its_commit_is_replaced_once(redis_url: str, run_name: str, tmp_path) -> None:
    """Synchronous: the round is out and the worker waits for commit 1, which waits for the group the trainer set
    aside. Its announcement (GroupsDropped) starts the replacement; the commit naming the group again starts no
    second one."""
    run_dir = make_run(tmp_path, run_name, async_level=0, concurrency=4, batch_groups=2, max_tokens=3)
    worker, model, stop, task = await _worker_on_version_0(redis_url, run_dir)
    groups = await wait_for(redis_url, run_name, 2)
    await asyncio.sleep(0.5)
    assert worker.started == 2 and not worker.in_flight  # waiting for commit 1
    await announce_drops(redis_url, run_name, 1, [groups[0].group_id])
    await wait_for(redis_url, run_name, 3)
    await asyncio.sleep(0.5)
    assert worker.started == 3  # the replacement, before any commit
    await publish_weights(redis_url, run_dir, 1, model, commit=True, dropped=[groups[0].group_id])
    await wait_for(redis_url, run_name, 5)
    await asyncio.sleep(0.5)
    assert worker.started == 5  # round 1 alone: the group counted once
    stop.set()
    await asyncio.wait_for(task, 20)


async def test_new_weights_reach_the_running_worker(redis_url: str, run_name: str, tmp_path) -> None:
    run_dir = make_run(tmp_path, run_name, async_level=100)
    worker, model, stop, task = await _worker_on_version_0(redis_url, run_dir)
    await wait_for(redis_url, run_name, 2)
    await publish_weights(redis_url, run_dir, 1, model, commit=False)
    deadline = time.monotonic() + 20
    while not any(s.spans[-1][1] == 1 for g in await stream_events(redis_url, run_name, "trajectories")
                  for s in g.samples):
        assert time.monotonic() < deadline, "no group was sampled under version 1"
        await asyncio.sleep(0.05)
    stop.set()
    await asyncio.wait_for(task, 20)


async def test_big_routing_goes_to_the_blob_store(redis_url: str, run_name: str, tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(rollout, "ROUTING_INLINE_BYTES", 0)
    run_dir = make_run(tmp_path, run_name, async_level=0)
    worker = RolloutWorker(run_dir, redis_url, 0, load(run_dir / "config.toml"))
    await publish_weights(redis_url, run_dir, 0, initial_model(run_dir), commit=False)
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    (group, _) = await wait_for(redis_url, run_name, 2)
    stop.set()
    await asyncio.wait_for(task, 20)
    trace = next(t for t in await stream_events(redis_url, run_name, "routing") if t.group_id == group.group_id)
    assert trace.experts == [] and trace.blob is not None
    routing = decode_routing(trace, BlobStore(run_dir / "blobs").get(trace.blob))  # as the trainer reads it
    assert [r.shape[0] for r in routing] == [len(group.prompt.numpy()) + len(s.tokens.numpy()) - 1
                                            for s in group.samples]


async def test_stop_abandons_unfinished_groups_unpublished(redis_url: str, run_name: str, tmp_path,
                                                           monkeypatch) -> None:
    monkeypatch.setattr(rollout, "DRAIN_TIMEOUT_S", 0.0)
    run_dir = make_run(tmp_path, run_name, async_level=0, max_tokens=200)
    worker = RolloutWorker(run_dir, redis_url, 0, load(run_dir / "config.toml"))
    await publish_weights(redis_url, run_dir, 0, initial_model(run_dir), commit=False)
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    while not worker.in_flight:
        await asyncio.sleep(0.01)
    stop.set()
    await asyncio.wait_for(task, 20)
    published = {g.group_id for g in await stream_events(redis_url, run_name, "trajectories")}
    assert worker.abandoned and not set(worker.abandoned) & published
    assert len(published) == worker.published


async def test_killed_worker_loses_no_group_and_a_new_one_uses_fresh_seqs(redis_url: str, run_name: str,
                                                                         tmp_path) -> None:
    run_dir = make_run(tmp_path, run_name, async_level=100)
    await publish_weights(redis_url, run_dir, 0, initial_model(run_dir), commit=False)
    code = (f"from pathlib import Path; from reel.producers.rollout import main; "
            f"main(Path({str(run_dir)!r}), {redis_url!r}, 0)")
    with open(tmp_path / "worker.log", "wb") as out:
        proc = subprocess.Popen([sys.executable, "-c", code], env=dict(os.environ, REEL_TORCH_THREADS="1"),
                                stdout=out, stderr=subprocess.STDOUT)
    try:
        await wait_for(redis_url, run_name, 3, timeout=40)
    except AssertionError:
        raise AssertionError((tmp_path / "worker.log").read_text()[-3000:]) from None
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    assert proc.returncode == -signal.SIGKILL
    before = await stream_events(redis_url, run_name, "trajectories")
    traces = await stream_events(redis_url, run_name, "routing")
    assert {g.group_id for g in before} == {t.group_id for t in traces if isinstance(t, RoutingTrace)}
    old_seqs = {e.seq for e in before + traces} | {e.seq for e in await stream_events(redis_url, run_name, "control")}

    worker = RolloutWorker(run_dir, redis_url, 0, load(run_dir / "config.toml"))
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    await wait_for(redis_url, run_name, len(before) + 2)
    stop.set()
    await asyncio.wait_for(task, 20)
    after = (await stream_events(redis_url, run_name, "trajectories"))[len(before):]
    assert worker.seq_base == max(old_seqs) + 1
    assert all(g.seq > max(old_seqs) for g in after)
    assert not {g.group_id for g in after} & {g.group_id for g in before}


async def test_a_cut_connection_never_leaves_half_a_group(redis_url: str, run_name: str, tmp_path) -> None:
    """The connection dies between a group's Trajectory and its RoutingTrace: Redis keeps neither, and
    the publish is tried again on a new connection (bus/redis_boundary.py), so the worker goes on."""
    run_dir = make_run(tmp_path, run_name, async_level=0)
    async with FaultProxy(redis_url) as proxy:
        worker = RolloutWorker(run_dir, proxy.url, 0, load(run_dir / "config.toml"))
        stop = asyncio.Event()
        task = asyncio.create_task(worker.run(stop))
        while worker.publisher is None:  # seq recovery reads the routing stream too: arm the cut after it
            await asyncio.sleep(0.01)
        proxy.cut_before(f"{{{run_name}}}:routing".encode())
        await publish_weights(redis_url, run_dir, 0, initial_model(run_dir), commit=False)
        await wait_for(redis_url, run_name, 2, timeout=60)
        stop.set()
        await asyncio.wait_for(task, 20)
        assert proxy.cuts == 1
    groups = [t.group_id for t in await stream_events(redis_url, run_name, "trajectories")]
    traces = [t.group_id for t in await stream_events(redis_url, run_name, "routing")]
    assert len(groups) >= 2 and groups == traces
