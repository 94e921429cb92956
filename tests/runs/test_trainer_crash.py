"""Exactly-once training across crashes: the trainer is SIGKILLed at each stage of its commit
protocol, restarted, and finishes; no group is trained twice and none is lost."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgspec
import numpy as np
import pytest
import redis
import torch

from reel.bus.events import (STREAMS, MalformedEvent, RoutingTrace, Sample, StepCommitted, StepTiming, Tensor,
                        Trajectory, WeightsPublished, decode, stream_key)
from reel.bus.run_log import RunLog
from reel.bus.streams import DEAD, Publisher, connect, safe_trim
from reel.consumers import trainer as trainer_mod
from reel.consumers.archiver import Archiver
from reel.consumers.trainer import CRASH_STAGES, STOPPED_EXIT
from reel.runtime.config import run as config_mod
from runbuilder import TINY_MODEL_TOML
from reel.runtime.train.initial_policy import ensure_initial_policy, load_initial_model
from reel.producers.warmstart import warm_start

pytestmark = pytest.mark.slow

CONFIG = """
[run]
name = "{name}"
steps = 3
{model}[init]
warmup_steps = 0
[rollout]
concurrency = 2
group_size = 3
[trainer]
batch_groups = 2
checkpoint_every = 2
max_off_policy_steps = 4
"""
GROUPS = 8


def _groups(run_dir: Path, run: str) -> list[tuple[Trajectory, RoutingTrace]]:
    """Groups sampled from the run's initial policy (real logprobs and routing)."""
    model = load_initial_model(run_dir)
    gen = torch.Generator().manual_seed(0)
    out = []
    for g in range(GROUPS):
        prompt = torch.randint(3, model.config.vocab_size, (4,), generator=gen)
        samples, routing = [], []
        for s in range(3):
            completion = torch.randint(3, model.config.vocab_size, (3,), generator=gen)
            with torch.no_grad():
                o = model(torch.cat([prompt, completion[:-1]])[None], return_routing=True)
            logp = torch.log_softmax(o.logits[0], -1)[3:].gather(-1, completion[:, None])[:, 0]
            samples.append(Sample(tokens=Tensor.from_torch(completion.int()), logprobs=Tensor.from_torch(logp),
                                  reward=float(s == g % 3), finish_reason="stop", seed=s, spans=[(0, 0)]))
            routing.append(Tensor.from_numpy(o.routing[0].numpy().astype(np.uint8)))
        gid = f"0-0-{g}"
        out.append((Trajectory(run=run, producer="rollout:0", seq=2 * g, group_id=gid, env="t",
                               prompt=Tensor.from_torch(prompt.int()), samples=samples, worker="0"),
                    RoutingTrace(run=run, producer="rollout:0", seq=2 * g + 1, group_id=gid, experts=routing)))
    return out


async def _publish(url: str, events: list) -> None:
    r = connect(url)
    try:
        await Publisher(r, events[0].run, "rollout:0", 0).publish(events)
    finally:
        await r.aclose()


def _trainer(run_dir: Path, url: str, crash_at: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "REEL_CRASH_AT"}
    if crash_at:
        env["REEL_CRASH_AT"] = crash_at
    argv = [sys.executable, "-m", "reel.runtime.launch.cli", "role", "trainer", "--run", str(run_dir), "--bus", url]
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=180)


@pytest.mark.parametrize("stage", CRASH_STAGES)
def test_crash_at_each_commit_stage_then_resume(tmp_path: Path, redis_url: str, run_name: str, stage: str) -> None:
    run_dir = tmp_path / "run"
    for sub in ("log", "blobs", "roles"):
        (run_dir / sub).mkdir(parents=True)
    (run_dir / "config.toml").write_text(CONFIG.format(name=run_name, model=TINY_MODEL_TOML))
    config = config_mod.load(run_dir / "config.toml")
    ensure_initial_policy(run_dir, config, warm_start)
    groups = _groups(run_dir, run_name)
    asyncio.run(_publish(redis_url, [e for pair in groups for e in pair]))

    crashed = _trainer(run_dir, redis_url, f"2:{stage}")
    assert crashed.returncode == -9, crashed.stderr[-2000:]
    finished = _trainer(run_dir, redis_url, None)
    assert finished.returncode == 0, finished.stderr[-2000:]

    client = redis.Redis.from_url(redis_url)
    commits = [decode(f[b"e"]) for _, f in client.xrange(stream_key(run_name, "steps"))]
    commits = [c for c in commits if isinstance(c, StepCommitted)]
    assert [c.step for c in commits] == [1, 2, 3]
    trained = [g for c in commits for g in c.groups] + [d.group_id for c in commits for d in c.dropped]
    assert len(trained) == len(set(trained)) == 6, "a group was trained twice or lost"
    # The groups not trained are still the trainer's to read: pending for it or not yet delivered.
    info = {g["name"].decode(): g for g in client.xinfo_groups(stream_key(run_name, "trajectories"))}
    last = info["trainer"]["last-delivered-id"].decode()
    entries = client.xrange(stream_key(run_name, "trajectories"))
    pending = {p["message_id"].decode() for p in client.xpending_range(
        stream_key(run_name, "trajectories"), "trainer", min="-", max="+", count=100)}
    still_available = {decode(f[b"e"]).group_id for eid, f in entries
                       if eid.decode() in pending or _after(eid.decode(), last)}
    assert still_available | set(trained) == {f"0-0-{g}" for g in range(GROUPS)}
    assert not still_available & set(trained)


def _after(entry_id: str, last: str) -> bool:
    a, b = (tuple(int(x) for x in i.split("-")) for i in (entry_id, last))
    return a > b


def _prepare(tmp_path: Path, url: str, run: str, groups: int = GROUPS, *, bad_routing: bool = False) -> Path:
    """A run dir with its initial policy, and `groups` groups of it on the bus; with bad_routing,
    the first group's trace is one token short."""
    run_dir = tmp_path / "run"
    for sub in ("log", "blobs", "roles"):
        (run_dir / sub).mkdir(parents=True)
    (run_dir / "config.toml").write_text(CONFIG.format(name=run, model=TINY_MODEL_TOML))
    ensure_initial_policy(run_dir, config_mod.load(run_dir / "config.toml"), warm_start)
    pairs = _groups(run_dir, run)[:groups]
    if bad_routing:
        trajectory, trace = pairs[0]
        short = [Tensor.from_numpy(t.numpy()[:-1]) for t in trace.experts]
        pairs[0] = (trajectory, msgspec.structs.replace(trace, experts=short))
    asyncio.run(_publish(url, [e for pair in pairs for e in pair]))
    return run_dir


def _steps_on_bus(url: str, run: str) -> list[int]:
    entries = redis.Redis.from_url(url).xrange(stream_key(run, "steps"))
    return [e.step for e in (decode(f[b"e"]) for _, f in entries) if isinstance(e, StepCommitted)]


def test_sigterm_before_the_last_step_is_not_success(tmp_path: Path, redis_url: str, run_name: str) -> None:
    """A stopped trainer exits non-zero, so no launcher announces RunFinished("completed")."""
    run_dir = _prepare(tmp_path, redis_url, run_name, groups=2)  # one step's worth of 3
    argv = [sys.executable, "-m", "reel.runtime.launch.cli", "role", "trainer", "--run", str(run_dir), "--bus", redis_url]
    trainer = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while _steps_on_bus(redis_url, run_name) != [1]:
            assert trainer.poll() is None and time.monotonic() < deadline, trainer.communicate()[0][-2000:]
            time.sleep(0.2)
        trainer.send_signal(signal.SIGTERM)
        out, _ = trainer.communicate(timeout=60)
    finally:
        if trainer.poll() is None:
            trainer.kill()
    assert trainer.returncode == STOPPED_EXIT, out[-2000:]
    assert "stopped before the last step" in out


async def _archive_everything(run_dir: Path, url: str, run: str) -> None:
    """Run an archiver until every stream's entries are in the log (acked by its group)."""
    stop = asyncio.Event()
    running = asyncio.ensure_future(Archiver(run_dir, url, run, block_ms=100).run(stop))
    client = connect(url)
    try:
        deadline = time.monotonic() + 30
        while True:
            assert time.monotonic() < deadline and not running.done(), "the archiver did not drain the bus"
            await asyncio.sleep(0.1)
            drained = True
            for stream in STREAMS:
                key = stream_key(run, stream)
                last = await client.xrevrange(key, count=1)
                groups = {g["name"]: g for g in await client.xinfo_groups(key)} if last else {}
                archiver = groups.get(b"archiver")
                drained &= not last or (archiver is not None and archiver["pending"] == 0
                                        and archiver["last-delivered-id"] == last[0][0])
            if drained:
                break
    finally:
        stop.set()
        await running
        await client.aclose()


def _lose_the_last_second(url: str, run: str, step: int) -> None:
    """What Redis restarted from an AOF without its last second looks like: step `step`'s commit
    and weights gone, the trainer's seq mark back where it was before them."""
    client = redis.Redis.from_url(url)
    lost = []
    for stream in ("steps", "weights"):
        for entry_id, fields in client.xrange(stream_key(run, stream)):
            event = decode(fields[b"e"])
            if getattr(event, "step", None) == step:
                client.xdel(stream_key(run, stream), entry_id)
                lost.append(event.seq)
    assert len(lost) == 2
    client.zadd(stream_key(run, "seq"), {"trainer:0": min(lost) - 1})


def _garbage_on_every_stream(url: str, run: str) -> None:
    client = redis.Redis.from_url(url)
    future = msgspec.msgpack.encode({"type": "from_the_future", "run": run, "producer": "x:0", "seq": 0})
    for stream in STREAMS:
        client.xadd(stream_key(run, stream), {"e": b"\xc1 not msgpack"})
        client.xadd(stream_key(run, stream), {"e": future})
        client.xadd(stream_key(run, stream), {"x": b"no e field"})


def test_resume_after_redis_lost_the_newest_commit(tmp_path: Path, redis_url: str, run_name: str) -> None:
    """Step 2 is in the log but Redis lost it, and every stream holds entries that are not events:
    the trainer resumes at 2 without reusing a seq, puts version 2 back on the bus, and finishes.
    One group's routing trace does not fit its tokens: that group is dropped, not trained without R3."""
    run_dir = _prepare(tmp_path, redis_url, run_name, bad_routing=True)
    crashed = _trainer(run_dir, redis_url, "2:acked")
    assert crashed.returncode == -9, crashed.stderr[-2000:]
    asyncio.run(_archive_everything(run_dir, redis_url, run_name))
    _lose_the_last_second(redis_url, run_name, 2)
    _garbage_on_every_stream(redis_url, run_name)

    finished = _trainer(run_dir, redis_url, None)
    assert finished.returncode == 0, finished.stderr[-2000:]
    assert "policy version 2 was missing from the bus" in finished.stderr
    client = redis.Redis.from_url(redis_url)
    versions = [e.version for e in _bus_events(client, run_name, "weights") if isinstance(e, WeightsPublished)]
    assert 2 in versions and 3 in versions

    asyncio.run(_archive_everything(run_dir, redis_url, run_name))
    with RunLog(run_dir, readonly=True) as run_log:
        logged = [e for stream in STREAMS for _, e in run_log.events(stream)]
    keys = [(e.producer, e.seq) for e in logged]
    assert len(keys) == len(set(keys)), "a (producer, seq) was used twice"
    commits = sorted((e for e in logged if isinstance(e, StepCommitted)), key=lambda c: c.step)
    assert [c.step for c in commits] == [1, 2, 3]
    trained = [g for c in commits for g in c.groups]
    assert len(trained) == len(set(trained)) == 6
    # The group whose trace does not fit its tokens was dropped, with the reason; R3 ran every step.
    assert [(d.group_id, d.reason.split(":")[0]) for c in commits for d in c.dropped] == [("0-0-0", "bad_routing")]
    assert all(c.metrics["router_replay"] == 1.0 for c in commits)
    dead = client.xrange(stream_key(run_name, DEAD))
    assert len(dead) >= 3 * len(STREAMS)  # the archiver dead-lettered every bad entry


def _bus_events(client, run: str, stream: str) -> list:
    out = []
    for _, fields in client.xrange(stream_key(run, stream)):
        try:
            out.append(decode(fields.get(b"e", b"")))
        except MalformedEvent:
            pass
    return out


def test_resume_sees_commits_archived_and_trimmed_while_it_reads(tmp_path: Path, redis_url: str,
                                                                 run_name: str, monkeypatch) -> None:
    """The archiver logs, acks and trims steps 1-2 between the trainer's two reads of them."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.toml").write_text(CONFIG.format(name=run_name, model=TINY_MODEL_TOML))
    commits = [StepCommitted(run=run_name, producer="trainer:0", seq=s, step=s, version=s, groups=[f"g{s}"],
                             dropped=[], loss=0.0, grad_norm=0.0, weights_sha256="", timing=StepTiming(0, 0, 0))
               for s in (1, 2, 3)]
    asyncio.run(_publish(redis_url, commits))

    def archive_and_trim() -> None:
        async def go() -> None:
            await _archive_everything(run_dir, redis_url, run_name)
            client = connect(redis_url)
            try:
                assert await safe_trim(client, run_name, "steps") == 2  # steps 1 and 2 leave the bus
            finally:
                await client.aclose()
        thread = threading.Thread(target=asyncio.run, args=(go(),))
        thread.start()
        thread.join()

    read_log = trainer_mod.logged_events

    def logged_then_archived(run_dir_: Path, stream: str) -> list:
        events = read_log(run_dir_, stream)
        archive_and_trim()  # the archiver's turn, right after this read
        return events

    trainer = trainer_mod.Trainer(run_dir, redis_url, config_mod.load(run_dir / "config.toml"), warm_start)
    monkeypatch.setattr(trainer_mod, "logged_events", logged_then_archived)

    async def read() -> dict:
        trainer.redis = connect(redis_url)
        try:
            return await trainer._read_commits()
        finally:
            await trainer.redis.aclose()
    assert sorted(asyncio.run(read())) == [1, 2, 3]
