"""Chaos by forgery: every forged event of issue 26 is published into a live `reel run`. The run
completes, every step replays bitwise, each forgery is in the dead letters with its reason, and the
groups a (role-valid) worker got wrong are dropped with theirs (bus/trust.py, runtime/train/group_checks.py)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import numpy as np
import pytest
import redis

from reel.bus.events import (
    BlobRef, RoutingTrace, RunFinished, Sample, StepCommitted, StepTiming, Tensor, Trajectory, WeightsPublished,
    encode, stream_key,
)
from reel.bus.run_log import RunLog
from reel.bus.partitions import slot_key
from reel.bus.server import EmbeddedRedis
from reel.bus.streams import DEAD, Publisher, connect
from reel.runtime.launch.cli import main
from runbuilder import TINY_MODEL_TOML
from test_chaos import CONFIG, Launch, _commits

pytestmark = pytest.mark.slow

RUN = "chaos"  # test_chaos's config names the run
STEPS = 8
FAR = 10**6  # a seq no real producer of this run reaches


def _commit(producer: str, seq: int, step: int) -> StepCommitted:
    return StepCommitted(run=RUN, producer=producer, seq=seq, step=step, version=step, groups=[], dropped=[],
                         loss=0.0, grad_norm=0.0, weights_sha256="0" * 64, timing=StepTiming(0.0, 0.0, 0.0))


def _weights(producer: str, seq: int, version: int) -> WeightsPublished:
    missing = BlobRef(uri="file:///nowhere", sha256="f" * 64, nbytes=1)
    return WeightsPublished(run=RUN, producer=producer, seq=seq, version=version, step=version, weights=missing)


def _group(producer: str, seq: int, group_id: str, tokens: list[int], logprobs: int) -> Trajectory:
    sample = Sample(tokens=Tensor.from_numpy(np.asarray(tokens, np.int32)),
                    logprobs=Tensor.from_numpy(np.zeros(logprobs, np.float32)), reward=1.0,
                    finish_reason="stop", seed=0, spans=[(0, 0)])
    return Trajectory(run=RUN, producer=producer, seq=seq, group_id=group_id, env="reverse_text",
                      prompt=Tensor.from_numpy(np.asarray([1, 2], np.int32)), samples=[sample] * 3, worker=producer)


def _forge(url: str) -> dict[tuple[str, str], str]:
    """XADD every forgery straight to the streams, as anyone who can reach Redis could; (stream, entry id) ->
    the word its dead-letter reason must contain."""
    client = redis.Redis.from_url(url)
    rollout_mark = int(client.zscore(stream_key(RUN, "seq"), "rollout:0") or 0)
    forged = [
        ("steps", _commit("evil:0", 0, STEPS + 1), "only trainer publishes it"),
        ("steps", _commit("trainer:0", FAR, STEPS + 1), "beyond its published range"),
        ("weights", _weights("trainer:0", FAR + 1, 10**9), "beyond its published range"),
        ("weights", _weights("evil:0", 1, 2), "only trainer publishes it"),  # names a missing blob
        ("control", RunFinished(run=RUN, producer="evil:0", seq=0, reason="completed"), "only launcher or trainer"),
        ("control", RunFinished(run=RUN, producer="launcher:0", seq=FAR, reason="completed"),
         "seq 1000000 of launcher:0"),
        ("control", RunFinished(run="other", producer="launcher:0", seq=0, reason="completed"), "of run 'other'"),
    ]
    # rollout:0's seqs ahead of it: on main they deduplicate its real groups away, stalling the trainer
    for k in range(4):
        squat = _group("rollout:0", rollout_mark + 1000 + k, f"squat-{k}", [3, 4], 2)
        forged.append(("trajectories", squat, "beyond its published range"))
    ids = {}
    for stream, event, reason in forged:
        ids[stream, client.xadd(stream_key(RUN, stream), {"e": encode(event)}).decode()] = reason
    client.close()
    return ids


async def _bad_groups(url: str, vocab: int) -> list[str]:
    """A worker of a valid role (published through Publisher, so within its range) sending groups that
    cannot be trained: on main the first one crashed the trainer, and every resume after it."""
    events = []
    for group_id, tokens, logprobs in (("oov", [3, vocab + 5], 2), ("short-logprobs", [3, 4], 1)):
        events.append(_group("rollout:7", len(events), group_id, tokens, logprobs))
        events.append(RoutingTrace(run=RUN, producer="rollout:7", seq=len(events), group_id=group_id, experts=[]))
    async with connect(url) as client:
        await Publisher(client, RUN, "rollout:7").publish(events)  # records rollout:7's seq mark
    return ["oov", "short-logprobs"]


def test_forged_events_are_dead_lettered_and_the_run_completes_and_replays(tmp_path: Path) -> None:
    config = tmp_path / "chaos.toml"
    config.write_text(CONFIG.format(steps=STEPS, model=TINY_MODEL_TOML))
    run_dir = tmp_path / "run"
    launch = Launch(config, run_dir, resume=False)
    launch.wait_for_commits(run_dir, 1)
    url = (run_dir / "bus_url").read_text().strip()
    forged = _forge(url)
    vocab = int(json.loads((run_dir / "init" / "config.json").read_text())["vocab_size"])
    bad = asyncio.run(_bad_groups(url, vocab))
    out = launch.finish()
    assert launch.proc.returncode == 0, out[-3000:]

    commits = _commits(run_dir)
    assert [c.step for c in commits] == list(range(1, STEPS + 1))
    dropped = {d.group_id: d.reason for c in commits for d in c.dropped}
    assert dropped["oov"].startswith("invalid: sample 0 has token id") and "outside the vocabulary" in dropped["oov"]
    assert dropped["short-logprobs"] == "invalid: sample 0 has 1 logprobs for 2 tokens"
    assert not {g for c in commits for g in c.groups} & {*bad, *(f"squat-{k}" for k in range(4))}
    with RunLog(run_dir, readonly=True) as log:
        logged = {e.producer for s in log.names() for _, e in log.events(s)}
    assert "evil:0" not in logged

    with EmbeddedRedis(run_dir) as server:
        client = redis.Redis.from_url(server.url)
        dead = client.xrange(slot_key(stream_key(RUN, "control"), DEAD))
        client.close()
    by_entry = {(f[b"stream"].decode(), f[b"entry_id"].decode(), f[b"group"].decode()): f[b"reason"].decode()
                for _, f in dead}
    for (stream, entry_id), reason in forged.items():
        assert reason in by_entry.get((stream, entry_id, "archiver"), ""), (stream, entry_id, reason, by_entry)
        assert by_entry[stream, entry_id, "archiver"].startswith("untrusted: ")
        if stream == "trajectories":  # the trainer's group refuses them too
            assert reason in by_entry[stream, entry_id, "trainer"]
    assert main(["log", "verify", "--run", str(run_dir)]) == 0
    assert main(["replay", "step", str(STEPS), "--run", str(run_dir), "--json"]) == 0
