"""The mismatch role on a real Redis and a real run's log: what the bus lost, the log still gives it."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from reel.bus.events import MismatchSplit
from reel.bus.streams import Publisher, connect
from reel.consumers import mismatch
from reel.consumers.mismatch import MismatchRole
from reel.runtime.config.run import load
from rollout_setup import stream_events
from runbuilder import build_run


@pytest.mark.slow  # builds a run: ~15 s
def test_commits_trimmed_before_the_role_read_them_are_split_from_the_log(redis_url: str, run_name: str,
                                                                          tmp_path, monkeypatch) -> None:
    """A lagging role can find commits already trimmed from the bus (the archiver and trainer read them):
    it learns them from the log once caught up with the bus, splits them, and finishes at the last step."""
    monkeypatch.setattr(mismatch, "LOG_SYNC_S", 0.2)
    run_dir = build_run(tmp_path / "run", {"run": {"name": run_name}}, split="none")
    config = load(run_dir / "config.toml")
    hidden = run_dir.parent / "log-later"
    (run_dir / "log").rename(hidden)  # nothing logged yet when the role starts, and the bus holds nothing
    role = MismatchRole(run_dir, redis_url, config)
    hidden.rename(run_dir / "log")  # the archiver logged the whole run; the bus was trimmed before the role read it
    asyncio.run(asyncio.wait_for(role.run(asyncio.Event()), 60))
    assert role.finished
    splits = [e for e in asyncio.run(stream_events(redis_url, run_name, "steps")) if isinstance(e, MismatchSplit)]
    assert sorted(e.step for e in splits) == list(range(1, config.run.steps + 1))


@pytest.mark.slow  # builds a run: ~15 s
def test_a_commit_whose_weights_the_bus_trimmed_waits_for_the_log_not_passed_over(redis_url: str, run_name: str,
                                                                                  tmp_path) -> None:
    """The bus still holds the commits and groups, but the weights stream was trimmed (the archiver and the
    workers read it) before a late role read it: π_old's WeightsPublished is only in the log, once archived.
    The role waits for it there; it used to pass the step over as if retention had deleted the weights."""
    run_dir = build_run(tmp_path / "run", {"run": {"name": run_name}}, split="none")
    config = load(run_dir / "config.toml")
    asyncio.run(_republish(redis_url, run_name, run_dir, ["steps", "trajectories", "routing"]))
    hidden = run_dir.parent / "log-later"
    (run_dir / "log").rename(hidden)  # the role starts before the archiver logged the weights
    role = MismatchRole(run_dir, redis_url, config)
    hidden.rename(run_dir / "log")
    asyncio.run(asyncio.wait_for(role.run(asyncio.Event()), 60))
    splits = [e for e in asyncio.run(stream_events(redis_url, run_name, "steps")) if isinstance(e, MismatchSplit)]
    assert sorted(e.step for e in splits) == list(range(1, config.run.steps + 1))


async def _republish(url: str, run: str, run_dir, streams: list[str]) -> None:
    """The logged events of `streams` back on the bus, stamped by the roles that publish them (the built
    run's log names its builder)."""
    redis = connect(url)
    try:
        for stream in streams:
            role = "trainer:0" if stream == "steps" else "rollout:0"
            events = [msgspec.structs.replace(event, producer=role, seq=seq)
                      for seq, (_, event) in enumerate(mismatch.logged(run_dir, stream))]
            await Publisher(redis, run, role).publish(events)
    finally:
        await redis.aclose()
