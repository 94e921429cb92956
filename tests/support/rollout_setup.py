"""Shared by several tests (was test_rollout.py's)."""

from __future__ import annotations
import asyncio
import time
from pathlib import Path
import torch
from reel.bus.blob_backends.file import BlobStore
from reel.bus.events import DroppedGroup, GroupsDropped, StepCommitted, StepTiming, Trajectory, WeightsPublished, decode, stream_key
from reel.bus.streams import Publisher, connect
from reel.runtime.model.config import MoEConfig
from reel.runtime.model.model import MoEModel
from reel.runtime.model.weights import save, state_dict_bytes


def make_run(tmp_path: Path, run_name: str, *, async_level: int, concurrency: int = 2, batch_groups: int = 2,
             max_tokens: int = 6, env: str = "") -> Path:
    """A run directory as the trainer leaves it before version 0: config.toml and init/ (`env`: an [env] table)."""
    run_dir = tmp_path / run_name
    (run_dir / "blobs").mkdir(parents=True)
    (run_dir / "config.toml").write_text(f"""
[run]
name = "{run_name}"
[rollout]
concurrency = {concurrency}
group_size = 3
async_level = {async_level}
max_tokens = {max_tokens}
stats_every_s = 0.2
[trainer]
batch_groups = {batch_groups}
max_off_policy_steps = {max(async_level, 4)}
{env}""")
    torch.manual_seed(0)
    save(MoEModel(MoEConfig(vocab_size=49, initializer_range=0.1)), run_dir / "init")
    return run_dir

async def stream_events(url: str, run: str, stream: str) -> list:
    redis = connect(url)
    try:
        return [decode(fields[b"e"]) for _, fields in await redis.xrange(stream_key(run, stream))]
    finally:
        await redis.aclose()

async def wait_for(url: str, run: str, count: int, timeout: float = 20.0) -> list[Trajectory]:
    deadline = time.monotonic() + timeout
    while True:
        found = await stream_events(url, run, "trajectories")
        if len(found) >= count:
            return found
        assert time.monotonic() < deadline, f"only {len(found)} of {count} groups arrived"
        await asyncio.sleep(0.05)

def initial_model(run_dir: Path) -> MoEModel:
    from reel.runtime.model.weights import load as load_model

    return load_model(run_dir / "init")


async def publish_weights(url: str, run_dir: Path, version: int, model: MoEModel, *, commit: bool,
                          dropped: list[str] = ()) -> None:
    """What the trainer does after step `version`: WeightsPublished (+ StepCommitted, dropping the group ids
    `dropped` as stale) in one call."""
    redis = connect(url)
    try:
        ref = BlobStore(run_dir / "blobs").put(state_dict_bytes(model))
        trainer = Publisher(redis, run_dir.name, "trainer:0", next_seq=10 * version)
        events = [trainer.stamp(WeightsPublished, version=version, step=version, weights=ref)]
        if commit:
            events.append(trainer.stamp(StepCommitted, step=version, version=version, groups=[], loss=0.0,
                                        dropped=[DroppedGroup(g, "stale") for g in dropped],
                                        grad_norm=0.0, weights_sha256=ref.sha256, timing=StepTiming(0, 0, 0)))
        await trainer.publish(events)
    finally:
        await redis.aclose()


async def announce_drops(url: str, run: str, step: int, dropped: list[str]) -> None:
    """What the trainer does when it sets groups aside while gathering step `step`'s batch (before its commit)."""
    redis = connect(url)
    try:
        trainer = Publisher(redis, run, "trainer:0", next_seq=10 * step - 5)  # between publish_weights' seqs
        await trainer.publish([trainer.stamp(GroupsDropped, step=step, dropped=[DroppedGroup(g, "invalid: test")
                                                                                for g in dropped])])
    finally:
        await redis.aclose()
